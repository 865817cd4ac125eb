"""The process's exit waits for the relay's threads that may still be inside a gloo wait (``atexit``,
before finalization).

A send's thread (:func:`~lightning_wsync._planes.relay.hops.send_apart`), a tree leader's half
thread (:mod:`~lightning_wsync._planes.relay.leader.treehop`, left behind on a topology change)
and a thread a close's bounded join left running (a leader's member thread, the head's feed, a
hop's connector: :func:`left_behind`) is a daemon that may be blocked in gloo's ``wait()`` with
the GIL released; one part-written into (or part-read from) a peer that stopped, returns only at
its group timeout. When that wait returns while the
interpreter finalizes, the thread is ended by ``pthread_exit`` inside pybind11's GIL guard, a
``noexcept`` destructor: ``std::terminate``, and the process aborts (exit -6, "terminate called
without an active exception"; counted by ``tests/relay/stress_exit.py``, docs/reliability.md).
Waiting at ``atexit`` lets it return while Python still runs. ``os._exit`` and signals skip this;
they need not wait (the threads end with the process). The same abort was counted for a receive
left behind (a half thread's, ``stress_exit.py --side recv``), so these wait too. The wait runs
before the store closes to threads at exit (:mod:`~lightning_wsync._control.inflight`): a thread
waited for here may make store calls on its way out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lightning_wsync._control import inflight

log = logging.getLogger(__name__)

_EXIT_MARGIN_S = 1.0
_running: dict[threading.Thread, float] = {}  # a thread that may wait in gloo -> its group timeout
_lock = threading.Lock()


def running(thread: threading.Thread, timeout_s: float) -> None:
    """``thread`` runs gloo waits bounded by ``timeout_s`` each; the exit waits for it."""
    with _lock:
        for ended_ in [t for t in _running if t.ident is not None and not t.is_alive()]:
            del _running[ended_]  # started and ended without saying so (a thread left behind)
        _running[thread] = timeout_s


def start(target: Callable[[], None], name: str, timeout_s: float) -> threading.Thread:
    """A daemon thread named ``name`` running ``target`` (gloo waits bounded by ``timeout_s``
    each), started; the exit waits for it while it runs."""

    def run() -> None:
        try:
            target()
        finally:
            ended(threading.current_thread())

    thread = threading.Thread(target=run, name=name, daemon=True)
    running(thread, timeout_s)
    try:
        thread.start()
    except BaseException:
        ended(thread)
        raise
    return thread


def left_behind(thread: threading.Thread, timeout_s: float) -> None:
    """A close's bounded join left ``thread`` running, maybe inside a gloo wait bounded by
    ``timeout_s``: the exit waits for it too (forgotten once it has ended)."""
    if thread.is_alive():
        running(thread, timeout_s)


def ended(thread: threading.Thread) -> None:
    with _lock:
        _running.pop(thread, None)


def join_at_exit() -> None:
    """Wait for the threads still running, up to the longest group timeout from now plus a second."""
    with _lock:
        left = [(t, timeout) for t, timeout in _running.items() if t.is_alive()]
    if not left:
        return
    bound = max(timeout for _, timeout in left) + _EXIT_MARGIN_S
    log.info("relay: the process waits up to %.1f s at exit for %d thread(s) left behind to end (%s)", bound,
             len(left), ", ".join(t.name for t, _ in left))  # fmt: skip
    deadline = time.monotonic() + bound
    for thread, _ in left:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t, _ in left if t.is_alive()]
    if stuck:
        log.warning("relay: %s still running at exit after %.1f s; the process may abort as it ends", stuck, bound)


inflight.before_close(join_at_exit)  # at exit, before the store closes to threads
