"""Child processes for tests: forked from one server that has imported torch and this package.

A ``spawn`` child starts a fresh interpreter and imports torch, this package and its test
module again: ~2.2 CPU-seconds each on the 2-core CI machine, hundreds of times per run, and
on the critical path of every multi-process test (each waits for its children's "ready").
``forkserver`` forks each child from a server process that imported those once (per test
process): a child starts in ~0.1 s. The server starts at the first child, after pytest has
collected every test module, so its ``sys.path`` holds every test folder.

Two things a ``spawn`` child gets that a forked one would not, kept here:

- the environment as it is at ``start()`` (tests set ``WSYNC_HOST_ID`` for one child): each
  child takes the starting process's ``os.environ`` along and installs it before its target;
- a fresh interpreter: the server imports modules and starts no thread, so a child holds no
  lock another thread took (torch's thread pools start at first use, in the child).

A child's parent is the server, not the test: ``PR_SET_PDEATHSIG`` children die with the
server, which ends with the test process; tests stop children by PID (``children.track``).
"""

from __future__ import annotations

import os
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

PRELOAD = ["torch", "torch.distributed", "lightning_wsync", "lightning_wsync.testing.procs", "pytest", "psutil"]
"""Imported once by the server (what nearly every test child imports first)."""


class _Process(ForkServerProcess):
    """A forked child that runs its target under the environment of the moment it was started."""

    def start(self) -> None:
        self._environ = dict(os.environ)
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


class _Context(ForkServerContext):
    Process = _Process


def _context() -> Any:
    ctx = _Context()
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


CTX = _context()
"""Use as ``multiprocessing.get_context("spawn")``: ``CTX.Process``, ``CTX.Queue``, ``CTX.Pipe``..."""
