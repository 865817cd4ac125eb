"""``member/<rid>/state``: what a receiver says it holds and what it last refused.

The receiver writes it (:class:`StateReport`); the sender's push reports read it
(:func:`decode_state`).
"""

from __future__ import annotations

import queue

from lightning_wsync._control import keys
from lightning_wsync._control.records import MemberState, Rejection
from lightning_wsync._control.store import Control

__all__ = ["MemberState", "Rejection", "StateReport", "decode_state", "encode_state"]


def encode_state(acked: int, error: tuple[int, str] | None) -> object:
    return MemberState(acked, None if error is None else Rejection(*error)).encode()


def decode_state(ctl: Control, rid: int, raw: bytes) -> MemberState:
    """Raises WeightSyncRecordError / WeightSyncAuthError for a state that does not decode."""
    return ctl.decode(keys.member_state(rid), raw, MemberState)


class StateReport:
    """The receiver's side of ``member/<rid>/state``: newest version held, last rejection.

    Producers (``update()``, the network link) only queue; the watcher thread writes.
    """

    def __init__(self, rid: int = -1) -> None:
        self._rid = rid
        self._queue: queue.SimpleQueue[tuple[int, tuple[int, str] | None]] = queue.SimpleQueue()
        self._held = -1
        self._sealed: str | None = None  # the record last taken, as written

    def held(self, version: int) -> None:
        self._queue.put((version, None))

    def rejected(self, version: int, reason: str) -> None:
        self._queue.put((-1, (version, reason)))

    def moved_to(self, rid: int) -> None:
        """Report under ``rid`` from now on (a receiver registered again keeps what it holds)."""
        self._rid = rid
        self._sealed = None

    def write(self, ctl: Control, *, force: bool = False) -> None:
        """Write what was queued since the last write (one store round trip, if any); with
        ``force``, the record as last taken even when nothing was queued."""
        sealed = self.take(ctl)
        if sealed is None and force:
            if self._sealed is None:
                self._sealed = ctl.seal(self._key(), encode_state(self._held, None))
            sealed = self._sealed
        if sealed is not None:
            ctl.set_text(self._key(), sealed)

    @property
    def sealed(self) -> str | None:
        """The record as last taken or written (None: none yet under this rid)."""
        return self._sealed

    def take(self, ctl: Control) -> str | None:
        """The record, sealed, when something was queued since it was last taken (else None):
        a relay host-mate hands it to its leader, which writes it."""
        error: tuple[int, str] | None = None
        changed = False
        while True:
            try:
                version, err = self._queue.get_nowait()
            except queue.Empty:
                break
            changed = changed or version > self._held or err is not None  # the same version twice: once
            self._held = max(self._held, version)  # (a relay leader holds it at publish, then at apply)
            error = err or error
        if not changed:
            return None
        self._sealed = ctl.seal(self._key(), encode_state(self._held, error))
        return self._sealed

    def _key(self) -> str:
        return keys.member_state(self._rid)
