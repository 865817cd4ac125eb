"""A host leader's hop to the next leader in the chain: connected in the background,
its ``ready`` notes read ahead, never waited on long (see :mod:`~lightning_wsync._planes.relay.leader.hop` for the
receiving side).

The notes are read as the network links read theirs (:class:`~lightning_wsync._planes.net.notes.NoteWaiter`):
one blocking store wait per note, on a connection of the hop's own, instead of a ``check``
every 2 ms while a version goes down (~5.5 requests per host per push) and every few
seconds at idle. Nothing but the note ends a wait, except the hop's end: the leader's bell
nudges the reader when the chain moves (:meth:`Downstream.nudge`), and a nudge that finds
this hop superseded, or :meth:`Downstream.close`, writes the awaited key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from lightning_wsync._control import keys
from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.store import Control
from lightning_wsync._planes.delta.codec import DeltaHeader
from lightning_wsync._planes.delta.wire import Held, parse_ready_note
from lightning_wsync._planes.net.notes import NoteWaiter
from lightning_wsync._planes.relay import exits
from lightning_wsync._planes.relay.hops import (
    CHAIN_POLL_S,
    Chain,
    Stream,
    Superseded,
    error_text,
    hop_header,
    join_hop,
    mark_broken,
    read_chain,
)
from lightning_wsync._planes.relay.tidy import forget_hop
from lightning_wsync._planes.wire import DELTA, FULL, Interruptible, close_group
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)

_DOWNSTREAM_CONNECT_S = 2.0  # a version arriving before the next hop is connected waits this long for it
# A wait for the next note ends with the note, or with the hop (nudge, close); this bounds
# one whose wake-up was lost (an idle hop waits the whole time between two pushes: the
# store client logs a line per timed-out wait, so not often).
_NOTE_WAIT_S = 300.0


class Downstream:
    """This leader's hop to the next one in the chain: connected in the background, never waited on long."""

    def __init__(
        self, ctl: Control, stream: Stream, chain: Chain, rid: int | None, layout: Manifest, *,
        current: Callable[[int], bool], tree: int | None = None, pieces: int | None = None,
    ) -> None:  # fmt: skip
        """The hop to leader ``rid`` (None: there is no next leader) in ``chain``, or in its
        tree ``tree``, where a full version comes in ``pieces`` pieces (half of them).

        ``current(number)``: whether chain ``number`` is still served, known without a store
        request (the leader's :class:`~lightning_wsync._planes.relay.leader.bell.Bell`, which calls
        :meth:`nudge` after each look at the chain)."""
        self._ctl = ctl
        self._epoch = epoch = stream.number
        backend, addr, timeout_s = stream.backend, stream.addr, stream.timeout_s
        self._layout = layout
        self._timeout_s = timeout_s
        self._pieces = pieces
        self._rid = rid
        self._prefix = None if rid is None else keys.relay_hop_prefix(epoch, chain.number, rid, tree)
        self._pg: Interruptible | None = None
        self._works: list[object] = []
        self._sending: list[torch.Tensor] = []  # kept alive until their sends complete
        self._n = 0  # messages started on this hop
        self._notes_read = 0  # ready notes read (and deleted) on this hop
        self._broken = False
        self._ready = threading.Event()
        self._closed = threading.Event()
        self._notes: dict[int, Held | None] = {}  # n -> what the next leader holds, read ahead of message n
        self._notes_end: BaseException | None = None  # why no more notes come
        self._notes_cv = threading.Condition()
        self._leaving = threading.Event()  # superseded or closed: the notes' reader stops
        self._waiter = NoteWaiter(ctl, self._leaving, backstop_s=_NOTE_WAIT_S)
        self._chain_number = chain.number
        self._current = current
        self.missed = False  # a version went by while this hop was still connecting
        self._connector: threading.Thread | None = None
        if self._rid is not None:
            self._connector = threading.Thread(
                target=self._connect, args=(backend, addr), name=f"wsync-relay-down-{self._rid}", daemon=True
            )
            self._connector.start()

    def _connect(self, backend: str, addr: str) -> None:
        assert self._prefix is not None
        ctl = self._ctl.clone()

        def superseded() -> bool:
            return self._closed.is_set() or not self._current(self._chain_number)

        try:
            pg = join_hop(ctl, self._prefix, 0, backend, addr, self._timeout_s, superseded)
            self._pg = Interruptible(pg, backend)
        except Superseded:
            pass
        except Exception as exc:  # noqa: BLE001 - the next leader never came: drop it from the chain
            self._fail(exc)
        finally:
            self._ready.set()
        if self._pg is not None:
            self._read_notes(ctl, superseded)
            if isinstance(self._notes_end, Superseded):
                # The chain moved on (or this hop closed): a send waiting for the next leader's
                # receive ends now (one already on the socket only at timeout_s: see
                # Interruptible.interrupt). The next leader may have left this hop already, and a
                # send into a group nobody serves would block this leader for timeout_s, keeping
                # it out of the new chain as long.
                self._pg.interrupt()

    def _read_notes(self, ctl: Control, superseded: Callable[[], bool]) -> None:
        """Read the next leader's ``ready`` notes as it writes them (one blocking wait each),
        so that forwarding a version costs no store round trip (the store's replies queue
        behind a busy link)."""
        assert self._prefix is not None
        n = 0
        end: BaseException = Superseded(self._prefix)
        try:
            while not superseded():
                key = keys.ready(self._prefix, n)
                if not self._waiter.wait(ctl, key):
                    if self._waiter.woken or self._leaving.is_set():
                        break  # the key holds the wake, not a note; it goes with the hop's notes
                    continue  # the backstop: look at the chain, then wait again
                held, _ = parse_ready_note(ctl.get_text(key))
                ctl.delete(key)
                with self._notes_cv:
                    self._notes[n] = held
                    self._notes_cv.notify_all()
                n = self._notes_read = n + 1
        except Exception as exc:  # noqa: BLE001 - store trouble: the next begin() reports it
            end = exc
        with self._notes_cv:
            self._notes_end = end
            self._notes_cv.notify_all()

    def nudge(self) -> None:
        """The leader's bell read the chain: a hop it supersedes stops waiting for notes now."""
        if self._closed.is_set() or not self._current(self._chain_number):
            self._leaving.set()  # before the wake: a wait that starts after it returns at once
            self._waiter.wake()

    def _next_note(self) -> Held | None:
        """What the next leader holds before message ``self._n``; raises past ``timeout_s``."""
        deadline = time.monotonic() + self._timeout_s
        with self._notes_cv:
            while self._n not in self._notes:
                if self._notes_end is not None:
                    raise self._notes_end
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"leader rid={self._rid} not ready for the next version "
                                       f"within timeout_s={self._timeout_s}")  # fmt: skip
                self._notes_cv.wait(min(left, CHAIN_POLL_S))
            return self._notes.pop(self._n)

    def _fail(self, exc: BaseException) -> None:
        if not self._broken and self._rid is not None:
            self._broken = True
            try:
                if self._moved_on():  # the next leader left for a newer chain: it is not broken
                    log.debug("relay: hop to leader rid=%d ended with its chain: %s", self._rid, error_text(exc))
                    return
                log.warning("relay: hop to leader rid=%d failed: %s", self._rid, error_text(exc))
                mark_broken(self._ctl, self._epoch, self._rid)
            except (RuntimeError, WeightSyncError):
                pass

    def _moved_on(self) -> bool:
        if self._closed.is_set() or isinstance(self._notes_end, Superseded):  # the reader saw a newer chain
            return True
        current = read_chain(self._ctl, self._epoch)
        return current is None or current.number != self._chain_number

    def begin(self, version: int, seq: int, delta: DeltaHeader | None, raw: torch.Tensor | None) -> int | None:
        """Start ``version`` downstream; how it goes (FULL, DELTA), or None when there is no usable next hop.

        A delta goes on as a delta only when the next leader holds its exact base.
        """
        if self._rid is None or self._broken:
            return None
        if not self._ready.wait(_DOWNSTREAM_CONNECT_S) or self._pg is None:
            self.missed = self._pg is None and not self._ready.is_set()  # still connecting: resent once connected
            return None
        self.missed = False
        assert self._prefix is not None
        try:
            held = self._next_note()
            kind = FULL
            if delta is not None and raw is not None and held == Held(delta.base_version, delta.base_digest):
                kind = DELTA
            self._n += 1
            header = hop_header(version, seq, self._layout, kind, self._pieces)
            self._works, self._sending = [], []
            self.send(header)
            if kind == DELTA:
                assert raw is not None
                self.send(raw)
            log.debug("relay: version %d on to rid=%d %s", version, self._rid, "as a delta" if kind else "in full")
            return kind
        except Superseded:
            return None
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return None

    def send(self, piece: torch.Tensor) -> None:
        if self._broken or self._pg is None:
            return
        try:
            self._works.append(self._pg.send([piece], 1, 0))
            self._sending.append(piece)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def connected(self) -> bool:
        return self._pg is not None and not self._broken

    def finish(self) -> None:
        """Wait for this version's sends (bounded by the group timeout)."""
        works, self._works = self._works, []
        try:
            for work in works:
                try:
                    work.wait()  # type: ignore[attr-defined]
                except Exception as exc:  # noqa: BLE001
                    self._fail(exc)
                    return
        finally:
            self._sending = []

    def close(self) -> None:
        self._closed.set()
        self._leaving.set()
        self._waiter.wake()
        with self._notes_cv:
            self._notes_cv.notify_all()
        if self._connector is not None:
            self._connector.join(timeout=1.0)
            exits.left_behind(self._connector, self._timeout_s)  # maybe joining the hop (gloo): the exit waits
        # The next leader's waits on this hop end now (one of its sends already part-written: at its timeout_s).
        close_group(self._pg, 1, "")
        if self._prefix is not None:
            forget_hop(self._ctl, self._prefix, 0, spent=self._pg is not None, notes=(self._notes_read,))
