"""Child processes of the benchmark: spawned, tracked by PID, always reaped.

Every wait on a child is bounded; whatever is still alive when a :class:`Children`
block ends is killed by PID. Children also ask the kernel to kill them if the
benchmark process dies first (``PR_SET_PDEATHSIG``), so none outlives a killed run.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from types import FrameType, TracebackType

import torch

log = logging.getLogger(__name__)

CTX = mp.get_context("spawn")
_PR_SET_PDEATHSIG = 1


class BenchError(RuntimeError):
    """A benchmark child failed, or a bounded wait on one ran out."""


def init_child() -> None:
    """One torch thread (as in the reference figures); die with the parent."""
    torch.set_num_threads(1)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the parent's finally block still kills children by PID


def report_failure(conn: Connection, where: str) -> None:
    """Send the current exception to the parent; call from a child's ``except`` block."""
    try:
        conn.send(("error", where, traceback.format_exc(limit=8)))
    except (OSError, ValueError):
        pass  # parent gone


def receive(conn: Connection, timeout_s: float, what: str) -> tuple[object, ...]:
    """The next message from a child, within ``timeout_s``.

    Raises:
        BenchError: the child reported an error, exited, or sent nothing in time.
    """
    if not conn.poll(timeout_s):
        raise BenchError(
            f"bench: no {what} within {timeout_s:.0f} s; the machine may be overloaded (raise --timeout-s)"
        )
    try:
        msg = conn.recv()
    except EOFError:
        raise BenchError(f"bench: a child exited while waiting for {what}") from None
    if not isinstance(msg, tuple) or not msg:
        raise BenchError(f"bench: malformed message {msg!r} while waiting for {what}")
    if msg[0] == "error":
        raise BenchError(f"bench: child failed in {msg[1]} while waiting for {what}:\n{msg[2]}")
    return msg


class Children:
    """Processes started in a ``with`` block; joined (bounded) then killed by PID at its end.

    Also the tests' ``children`` fixture: processes started elsewhere (``subprocess``,
    ``multiprocessing``) are registered with :meth:`track` and SIGKILLed by :meth:`stop`.
    """

    def __init__(self, join_timeout_s: float = 10.0, context: SpawnContext | ForkServerContext | None = None) -> None:
        self._context: SpawnContext | ForkServerContext = context or CTX  # tests: a forkserver (tests/support/_spawn)
        self._procs: list[BaseProcess] = []
        self._tracked: list[int] = []
        self._join_timeout_s = join_timeout_s

    def start(self, target: Callable[..., None], args: tuple[object, ...], name: str) -> Connection:
        """Start ``target(conn, *args)`` in a child of this block's context (spawned, unless a
        forkserver's was given); returns the parent's end of the pipe."""
        parent, child = self._context.Pipe()
        proc = self._context.Process(target=target, args=(child, *args), name=name, daemon=True)
        proc.start()
        child.close()
        self._procs.append(proc)
        log.debug("started %s pid=%s", name, proc.pid)
        return parent

    def track(self, pid: int) -> int:
        """Kill ``pid`` at :meth:`stop` too (it is not joined: its starter reaps it)."""
        self._tracked.append(pid)
        return pid

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None] + self._tracked

    def stop(self) -> None:
        """Join each child until a shared deadline, then SIGKILL the rest by PID."""
        deadline = time.monotonic() + self._join_timeout_s
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive() and proc.pid is not None:
                log.debug("killing %s pid=%d", proc.name, proc.pid)
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.join(timeout=5)
        for pid in self._tracked:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._procs.clear()
        self._tracked.clear()

    def __enter__(self) -> Children:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self._join_timeout_s = 0.0  # failing: don't wait for children that may be stuck
        self.stop()


def exit_on_sigterm() -> Callable[[], None]:
    """Turn SIGTERM into SystemExit so ``finally`` blocks reap the children; returns an undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore
