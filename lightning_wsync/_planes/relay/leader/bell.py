"""A relay leader's doorbell: what it serves (the chain, its own leadership) without polling the store.

Reading the chain record and its leader record every ``CHAIN_POLL_S`` in each of a leader's
loops (its hop from upstream, its hop downstream, waiting to be in a chain) would cost
about 60 requests a second per host while idle. Instead one thread per leader waits on
its bell key (``relay/<epoch>/bell/<rid>``, one blocking wait on a connection of its own)
and reads both records when the bell rings; the loops look at what it read, in memory.
Whoever changes what the leader serves rings it: the sender after each new chain number
(every leader of the old and the new chain, and every leader it knows), a host-mate that
takes over the host, and the leader itself when it steps down. The sender also rings every
leader it knows when it closes, and a new sender rings the previous epoch's chain: the
leader's watcher, which a ring wakes (``listen``), then reads the store's ``news`` and finds
the close or the new sender without a poll of its own. The owner rings it again when it has
not rung for ``timing.bell_backstop_s`` (a lost ring costs at most that long), so the blocking wait never
reaches its own timeout (the store client logs one line when it does). Its own leader record is
looked at more often, every ``timing.hosted_beat_s`` (one read, by whoever asks ``current``): a
record overwritten by someone who rings nobody (garbled by a store writer, issue 32) rings the
bell within a beat period instead of at the backstop. A leader in no chain (its sender may be
dead, and a new sender rings only the old chain's leaders) also looks at ``news`` then, and
rings its bell when it moved: its watcher, woken, finds the new sender.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lightning_wsync._control import keys
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import Timing
from lightning_wsync._planes.relay.hops import CHAIN_POLL_S, Chain, error_text, read_chain, ring_bell
from lightning_wsync._planes.relay.leader.elect import Election
from lightning_wsync._planes.relay.tidy import peek
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)



class Bell:
    """A leader's view of the chain and of its own leadership, kept current by its doorbell.

    ``chain`` and ``leads`` are what the bell's thread last read; :meth:`current` says
    whether a chain number is still the one to serve; listeners (``listen``) are called
    after each read (a hop's reader, to look again at once).
    """

    def __init__(self, control: Control, election: Election, *, epoch: int, rid: int, timing: Timing) -> None:
        self._control = control
        self._election = election
        self._epoch = epoch
        self._rid = rid
        self._backstop_s = timing.bell_backstop_s  # what the thread read is read again at least this often
        self._wait_s = timing.bell_wait_s  # a wait's own bound; the backstop's ring ends it much sooner
        self._key = keys.relay_bell(epoch, rid)
        self._ctl = control.clone()  # its waits block this connection
        self._stop = threading.Event()
        self._listeners: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.chain: Chain | None = None
        self.named = True  # the store's leader record names this receiver, as last read
        self._due = 0.0  # when current() rings the bell itself (a lost ring costs at most the backstop)
        self._look_s = timing.hosted_beat_s  # the leader record is looked at this often (one read)
        self._look_due = 0.0
        self._raw: str | None = None  # the leader record as the thread last read it
        self._news: str | None = "\x00unread"  # ``news`` at the last look while in no chain (first look rings)
        self._read()
        self._thread = threading.Thread(target=self._run, name=f"wsync-relay-bell-r{rid}", daemon=True)
        self._thread.start()

    def current(self, number: int) -> bool:
        """Chain ``number`` is still the one to serve, and this receiver still leads (no request;
        rings the bell when it has not rung for ``timing.bell_backstop_s``)."""
        if time.monotonic() >= self._due:
            self._due = time.monotonic() + self._backstop_s  # one backstop ring, whoever asks first
            try:
                ring_bell(self._control, self._epoch, self._rid)
            except WeightSyncError as exc:
                log.debug("relay: bell of rid=%d not rung: %s", self._rid, exc)
        elif time.monotonic() >= self._look_due:
            self._look_due = time.monotonic() + self._look_s
            try:
                moved = peek(self._control, self._election.key) != self._raw  # changed with no ring
                if number == -1:  # in no chain (its sender may be dead): a new sender rings only the old chain
                    news, self._news = self._news, peek(self._control, keys.NEWS)
                    moved = moved or news != self._news
                if moved:  # read again; the ring wakes the watcher, which reads the news
                    self._due = time.monotonic() + self._backstop_s
                    ring_bell(self._control, self._epoch, self._rid)
            except WeightSyncError as exc:
                log.debug("relay: leader record of rid=%d not looked at: %s", self._rid, exc)
        chain = self.chain
        return not self._stop.is_set() and self.named and chain is not None and chain.number == number

    def listen(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` after each read; returns the call that stops it."""
        with self._lock:
            self._listeners.append(listener)

        def stop() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return stop

    def _read(self) -> None:
        self.chain = read_chain(self._ctl, self._epoch)
        raw, record = self._election.read(self._ctl)
        self._raw = raw
        self.named = record is not None and record.rid == self._rid
        self._due = time.monotonic() + self._backstop_s
        self._look_due = time.monotonic() + self._look_s

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rung = self._ctl.wait_for(self._key, self._wait_s)
                if rung:
                    self._ctl.delete(self._key)  # before the reads: a ring after them is a new wake-up
                if self._stop.is_set():
                    break
                self._read()
            except Exception as exc:  # noqa: BLE001 - the bell must outlive a bad read; the store may come back
                log.debug("relay: bell of rid=%d: %s", self._rid, error_text(exc))
                self._stop.wait(CHAIN_POLL_S)
            with self._lock:
                listeners = list(self._listeners)
            for listener in listeners:
                listener()

    def close(self) -> None:
        """Stop the thread (its wait is ended by a ring; the key is deleted on the way out)."""
        self._stop.set()
        try:
            ring_bell(self._control, self._epoch, self._rid)
        except WeightSyncError:
            pass  # the store is gone: the wait fails by itself
        self._thread.join(timeout=5)
        try:
            self._control.delete(self._key)
        except WeightSyncError:
            pass
