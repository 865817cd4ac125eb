"""Store calls in flight, and the process's exit: at ``atexit`` (before finalization) no thread but
the main one enters the store again, and the exit waits, bounded, for the calls still inside it.

Every store call of the package (:class:`~lightning_wsync._control.store.Control`) runs with the GIL
released inside a pybind11 guard. One that returns while the interpreter finalizes, on a daemon
thread, is ended by ``pthread_exit`` inside that guard's ``noexcept`` destructor:
``std::terminate``, and the process aborts (exit -6, "terminate called without an active
exception"; the same abort as a gloo wait's, :mod:`~lightning_wsync._planes.relay.exits`). The
threads that wait long in the store (a relay leader's bell, a network link's notes: 60 s) are
woken here by a write of the key they wait for, on a connection of its own; every other call is
short, bounded by the store's timeout. A thread that comes out of the store after the exit began,
or tries to go in, waits on a Python event until the process ends: it runs nothing more (its
state is the process's, which is ending). ``os._exit`` and signals skip this.
``tests/control/test_store_exit.py`` and ``tests/relay/stress_exit.py --side store`` count it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)

WOKEN_S = 2.0  # a woken wait comes out within this (one round trip on a fresh connection)
_UNWOKEN_S = 10.0  # the longest the exit waits for a call it cannot wake
_EXIT_MARGIN_S = 1.0


@dataclass(frozen=True)
class _Call:
    thread: threading.Thread
    deadline: float  # monotonic; the call's own bound
    wake: Callable[[], None] | None  # ends the call early (a blocking wait: writes its key)


_lock = threading.Condition()
_calls: dict[object, _Call] = {}
_closed = False  # the exit began: no thread but the main one goes into the store again
_before_close: list[Callable[[], None]] = []


@contextmanager
def store_call(bound_s: float, wake: Callable[[], None] | None = None) -> Iterator[None]:
    """Around one call into the store, bounded by ``bound_s``; ``wake`` ends it early, for a
    blocking wait. On a thread other than the main one once the exit began, never returns."""
    main = threading.current_thread() is threading.main_thread()
    token = object()
    with _lock:
        if _closed and not main:
            _park()
        _calls[token] = _Call(threading.current_thread(), time.monotonic() + max(0.0, bound_s), wake)
    try:
        yield
    finally:
        with _lock:
            del _calls[token]
            _lock.notify_all()
            if _closed and not main:
                _park()


def before_close(hook: Callable[[], None]) -> None:
    """Run ``hook`` at exit before the store closes to threads (a wait for threads that may make
    store calls on their way out: the relay's, :mod:`~lightning_wsync._planes.relay.exits`)."""
    _before_close.append(hook)


def close_at_exit() -> None:
    """The ``atexit`` handler: the hooks, then close the store to every thread but the main one,
    wake the blocking waits and wait for the calls still in flight, each up to its own bound (a
    woken wait: ``WOKEN_S``; any other at most ``_UNWOKEN_S``), plus a second."""
    global _closed
    for hook in _before_close:
        try:
            hook()
        except Exception:  # noqa: BLE001 - the store must still close to threads
            log.exception("exit: %r failed", hook)
    with _lock:
        _closed = True
        left = {token: call for token, call in _calls.items() if call.thread is not threading.current_thread()}
    if not left:
        return
    now = time.monotonic()
    bounds = []
    for call in left.values():
        bound = min(call.deadline, now + _UNWOKEN_S)
        if call.wake is not None:
            try:
                call.wake()
                bound = min(bound, now + WOKEN_S)
            except Exception as exc:  # noqa: BLE001 - the store is gone: the call fails by itself
                log.debug("exit: %s's store wait not woken: %s", call.thread.name, exc)
        bounds.append(bound)
    deadline = max(bounds) + _EXIT_MARGIN_S
    log.info("store: the process waits up to %.1f s at exit for %d thread(s) in a store call (%s)",
             deadline - now, len(left), ", ".join(call.thread.name for call in left.values()))  # fmt: skip
    with _lock:
        _lock.wait_for(lambda: not any(token in _calls for token in left), max(0.0, deadline - now))
        stuck = [call.thread.name for token, call in left.items() if token in _calls]
    if stuck:
        log.warning("store: %s still in a store call at exit after %.1f s; the process may abort as it ends",
                    stuck, deadline - now)  # fmt: skip


def _park() -> None:
    """Wait until the process ends (called with ``_lock`` held: released while waiting)."""
    while True:
        _lock.wait()


def _after_fork() -> None:
    """A forked child has no thread of its parent's: no call in flight, a lock nobody holds."""
    global _lock
    _lock = threading.Condition()
    _calls.clear()


os.register_at_fork(after_in_child=_after_fork)
atexit.register(close_at_exit)
