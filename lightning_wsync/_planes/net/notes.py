"""What both ends of a network link share: their notes on the store (the receiver's
``ready``, the sender's announcement), waited for one blocking store wait each, and the
unit a full version travels in.
"""

from __future__ import annotations

import threading
import time

from lightning_wsync._control import keys
from lightning_wsync._control.store import Control
from lightning_wsync.errors import WeightSyncStoreError

_WAIT_BACKSTOP_S = 60.0  # longest wait on the store for a note; stop and silence end one sooner
PIECE_BYTES = 1 << 20  # a full version's unit on the wire: the sender's lease is renewed after each


class NoteWaiter:
    """A link thread's waits for its peer's notes: one blocking store wait per note, not a
    poll every few milliseconds, and :meth:`wake` to end a wait early.

    The thread waits on its own connection (a clone); :meth:`wake` writes the awaited key
    through the owner's, so ``stop()`` ends the wait at once, and so does a receiver's
    silence watch (:meth:`~lightning_wsync._planes.net.link.NetReceiveLink._watch_silence`).
    The key is the link's own (its prefix and number) and is deleted with its other notes.
    ``backstop_s`` bounds a wait whose wake-up was lost (the store logs a line when a wait
    times out: rare, on purpose).
    """

    def __init__(self, control: Control, stop: threading.Event, backstop_s: float = _WAIT_BACKSTOP_S) -> None:
        self._control = control
        self._stop = stop
        self._backstop_s = backstop_s
        self._lock = threading.Lock()  # a wake is written only into a wait in progress
        self._key: str | None = None
        self._woken = False
        self.waiting_since: float | None = None  # set while the thread is in a wait

    def wait(self, ctl: Control, key: str) -> bool:
        """True once the peer wrote ``key``; False after the backstop, on stop, or on a wake."""
        with self._lock:
            self._key, self._woken = key, False
            self.waiting_since = time.monotonic()
        try:
            if self._stop.is_set():  # after waiting_since is set: a stop() later than this wakes the wait
                return False
            return ctl.wait_for(key, self._backstop_s) and not (self._stop.is_set() or self._woken)
        finally:
            with self._lock:
                self.waiting_since = None

    @property
    def woken(self) -> bool:
        """The last wait was ended by :meth:`wake` (its key now holds the wake, not a note)."""
        return self._woken

    def wake(self) -> None:
        """End the wait in progress, if any, by writing its key (deleted with the link's notes:
        the wait cannot return, nor the thread delete its notes, before this write is done)."""
        with self._lock:
            if self.waiting_since is None or self._key is None:
                return
            self._woken = True
            try:
                self._control.set_text(self._key, "wake")
            except WeightSyncStoreError:
                pass  # the store is gone: the wait fails by itself


def forget_notes(ctl: Control, prefix: str, n: int) -> None:
    """Delete what a link that ended at its ``n``-th version may have left on the store."""
    for key in (keys.ready(prefix, n), keys.announcement(prefix, n)):
        ctl.delete(key)


