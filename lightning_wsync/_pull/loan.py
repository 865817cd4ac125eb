"""Versions lent straight out of the host's shared memory, without a private copy.

An engine worker on the trainer's host (every tensor-parallel rank of an engine there)
loads a version from the pinned snapshot slot's own tensor views instead of copying it
into a receiver-side copy first::

    loan = lender.lend(min_version, timeout_s, loaded)   # pin the slot, hand out its views
    engine.reload_weights(loan.tensors.items())          # reads the shared memory itself
    intact = lender.give_back()                          # unpin: were the bytes intact?

The pin is held from the stage step through the load (so the sender has one slot fewer
to write into meanwhile, and drops more pushes) and renewed every ``timing.pin_renew_s`` by a
thread here, so only a process that stops altogether (SIGSTOP, a hung host) loses its
slot to the sender's lease; ``give_back`` then says the bytes were not intact and the
caller must treat what it loaded as torn. Receivers whose versions come over the network
(or from a relay host's ring) keep copying: :attr:`SharedLender.copies` says which.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

from lightning_wsync._control.untrusted import unexpected
from lightning_wsync._planes.base import Lender, ReceiveSource, SlotRef
from lightning_wsync._pull.watcher import Watcher
from lightning_wsync.errors import WeightSyncClosedError, WeightSyncTimeoutError

log = logging.getLogger(__name__)


class Loan(NamedTuple):
    """One version lent out of shared memory: its selected tensors, read-only views of the slot."""

    version: int
    tensors: Mapping[str, torch.Tensor]


class SharedLender:
    """Lends a receiver's versions out of its shared-memory source (one loan at a time)."""

    def __init__(
        self, watcher: Watcher, apply_lock: threading.Lock, selects: Callable[[str], bool], verify: bool, name: str
    ) -> None:
        self._watcher = watcher
        self._apply_lock = apply_lock
        self._selects = selects
        self._verify = verify
        self._name = name
        self._held: tuple[ReceiveSource, Lender, SlotRef, Loan] | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def copies(self) -> bool:
        """Versions reach this receiver some other way than its host's shared memory (copy them)."""
        source = self._watcher.source
        return source is not None and source.lender() is None

    @property
    def loan(self) -> Loan | None:
        held = self._held
        return None if held is None else held[3]

    def lend(self, min_version: int | None, timeout_s: float, loaded: int | None) -> Loan | None:
        """Pin the newest complete version (with ``min_version``: one >= it, waiting up to
        ``timeout_s``) and lend it; a loan already held that qualifies is kept. The version
        ``loaded`` (the engine's own) is returned without a pin or tensors. None: nothing yet
        (``min_version`` None), or the versions come another way (:attr:`copies`).

        Raises:
            WeightSyncTimeoutError: no version >= ``min_version`` within ``timeout_s``.
            WeightSyncClosedError: the sender closed before publishing one.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            loan = self._try(min_version, loaded)
            if loan is not None or min_version is None or self.copies:
                return loan
            watcher = self._watcher
            if watcher.error is not None:
                raise watcher.error
            if watcher.sender_closed and not watcher.newer_pending(min_version - 1):
                raise WeightSyncClosedError(
                    f"receiver {self._name!r}: the sender closed before publishing version >= {min_version}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WeightSyncTimeoutError(
                    f"receiver {self._name!r}: no version >= {min_version} within timeout_s={timeout_s} (waited "
                    f"to lend it out of shared memory, zero_copy; newest published {watcher.latest!r}); is the "
                    f"trainer pushing? raise timeout_s otherwise"
                )
            watcher.wait_for_news(time.monotonic() + min(remaining, watcher.timing.wait_poll_s))

    def _try(self, min_version: int | None, loaded: int | None) -> Loan | None:
        with self._apply_lock:  # the watcher swaps sources under this lock
            source = self._watcher.source
            lender = None if source is None else source.lender()
            if source is None or lender is None:
                return None
            held = self._held
            if held is not None and held[0] is source:
                version = held[3].version
                if (min_version is None and not lender.pending_above(version)) or (
                    min_version is not None and version >= min_version
                ):
                    return held[3]
            self._release()
            sums = self._watcher.published_sums if self._verify else None
            got = lender.lend(None, sums, self._watcher.on_rejected)
            if got is None:
                return None
            ref, views = got
            if min_version is not None and ref.version < min_version:
                lender.give_back(ref)
                return None
            self._watcher.held(ref.version)  # staged: push reports count it delivered
            if ref.version == loaded:
                lender.give_back(ref)  # the engine holds it already: nothing to load, nothing to pin
                return Loan(ref.version, {})
            entries = lender.layout.entries
            loan = Loan(ref.version, {e.name: v for e, v in zip(entries, views) if self._selects(e.name)})
            self._held = source, lender, ref, loan
            self._renew()
            return loan

    def give_back(self) -> bool:
        """Let go of the loan; True when its bytes stayed intact from :meth:`lend` until now."""
        with self._apply_lock:
            return self._release()

    def _release(self) -> bool:
        held, self._held = self._held, None
        return True if held is None else held[1].give_back(held[2])

    def _renew(self) -> None:
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew_loop, name=f"wsync-loan-{self._name}", daemon=True)
            self._renewer.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self._watcher.timing.pin_renew_s):
            held = self._held
            try:
                if held is not None:
                    held[1].touch()
            except Exception as exc:  # noqa: BLE001 - a loan no longer renewed lapses: the slot may be reused
                unexpected(log, f"wsync-loan-{self._name}", exc)

    def close(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        self.give_back()
