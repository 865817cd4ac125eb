"""The process's exit waits for the relay's sends still running (``atexit``, before finalization).

A send's thread (:func:`~lightning_wsync._planes.relay.hops.send_apart`) is a daemon blocked in
gloo's ``wait()`` with the GIL released; one left behind on a topology change, part-written into
a peer that stopped reading, returns only at its group timeout. When that wait returns while the
interpreter finalizes, the thread is ended by ``pthread_exit`` inside pybind11's GIL guard, a
``noexcept`` destructor: ``std::terminate``, and the process aborts (exit -6, "terminate called
without an active exception"; counted by ``tests/relay/stress_exit.py``, docs/reliability.md).
Waiting at ``atexit`` lets it return while Python still runs. ``os._exit`` and signals skip this;
they need not wait (the threads end with the process).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

log = logging.getLogger(__name__)

_EXIT_MARGIN_S = 1.0
_running: dict[threading.Thread, float] = {}  # a send's thread -> its group timeout
_lock = threading.Lock()


def running(thread: threading.Thread, timeout_s: float) -> None:
    """``thread`` runs a send bounded by ``timeout_s`` per wait; the exit waits for it."""
    with _lock:
        _running[thread] = timeout_s


def ended(thread: threading.Thread) -> None:
    with _lock:
        _running.pop(thread, None)


def join_at_exit() -> None:
    """Wait for the sends still running, up to the longest group timeout from now plus a second."""
    with _lock:
        left = list(_running.items())
    if not left:
        return
    bound = max(timeout for _, timeout in left) + _EXIT_MARGIN_S
    log.info("relay: the process waits up to %.1f s at exit for %d send(s) left behind to end (%s)", bound,
             len(left), ", ".join(t.name for t, _ in left))  # fmt: skip
    deadline = time.monotonic() + bound
    for thread, _ in left:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t, _ in left if t.is_alive()]
    if stuck:
        log.warning("relay: %s still running at exit after %.1f s; the process may abort as it ends", stuck, bound)


atexit.register(join_at_exit)
