"""Push reports collected off the training thread, for WeightSyncCallback's metrics and lag control."""

from __future__ import annotations

import logging
import threading

from lightning_wsync._push.report import PushHandle, PushReport
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)


class ReportWaiter:
    """Awaits push reports off the training thread, newest push first.

    A receiver holding a newer version counts as delivered for every older one, so
    one wait on the newest queued push confirms all pushes up to it.
    """

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._queue: list[tuple[int, PushHandle]] = []
        self._done: list[tuple[int, PushReport]] = []
        self._confirmed = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="wsync-callback-reports", daemon=True)
        self._thread.start()

    def add(self, index: int, handle: PushHandle) -> None:
        with self._cond:
            self._queue.append((index, handle))
            self._cond.notify_all()

    def take(self) -> list[tuple[int, PushReport]]:
        with self._cond:
            done, self._done = self._done, []
        return done

    def wait_confirmed(self, index: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until push ``index`` (1-based) has its report."""
        with self._cond:
            return self._cond.wait_for(lambda: self._confirmed >= index, timeout=timeout_s)

    def close(self, *, flush: bool) -> None:
        with self._cond:
            if not flush:
                self._queue.clear()
            self._stopping = True
            self._cond.notify_all()
        # The thread's one blocking call is PushHandle.wait(), bounded by timeout_s: the
        # wait in progress, then one on the newest push.
        self._thread.join(timeout=2 * self._timeout_s + 5)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._stopping)
                if not self._queue:
                    return
                index, handle = self._queue[-1]
                self._queue.clear()
            try:
                report: PushReport | None = handle.wait()
            except WeightSyncError as exc:  # the store went away, the sender closed, a timeout
                log.warning("WeightSyncCallback: no report for version %d: %s", handle.version, exc)
                report = None
            except Exception:  # noqa: BLE001 - a dead thread would stall every later wait_confirmed
                log.exception("WeightSyncCallback: no report for version %d", handle.version)
                report = None
            with self._cond:
                if report is not None:
                    self._done.append((index, report))
                self._confirmed = index
                self._cond.notify_all()
