"""Scenario: a process of the session crashes natively; what the harness keeps of it.

A child on host 1 dereferences a null pointer (SIGSEGV) from a thread of its own; the
scenario reports :meth:`Procs.crashed`. With ``trainer`` as its second argument, the
scenario itself (the session's PID 1, as the trainer is in the other scenarios) then
crashes the same way, before printing a result.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from pathlib import Path
from typing import Any

from _scenario import Procs, main, wait_until

from lightning_wsync.testing.hosts import SimHosts

# A null pointer read from a thread, the main thread waiting: both stacks must be dumped.
CRASH = "import ctypes, threading; t = threading.Thread(target=ctypes.string_at, args=(0,)); t.start(); t.join()"


def scenario(argv: list[str]) -> dict[str, Any]:
    out, who = Path(argv[0]), argv[1]
    with SimHosts(2) as hosts:
        procs = Procs(hosts, out)
        child = procs.start("h1crash", 1, [sys.executable, "-c", CRASH])
        wait_until("the child to crash", lambda: child.poll() is not None, 60, procs)
        crashed = procs.crashed()
        if who == "trainer":
            threading.Thread(target=ctypes.string_at, args=(0,), name="crash").start()
            threading.Event().wait(30)  # the crash ends the session first
        return {"crashed": crashed}


if __name__ == "__main__":
    main(scenario)
