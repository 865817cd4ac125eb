"""A process ending normally while a daemon thread of it waits in the store (a relay leader's bell,
a network link's notes): the wait must not end while the interpreter finalizes (``_control/inflight.py``)."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

CHILD = Path(__file__).resolve().with_name("_store_wait_at_exit.py")


def test_a_thread_left_in_a_store_wait_never_aborts_the_exit(server: dist.TCPStore, port: int) -> None:
    """The child's thread waits for ``bell`` (30 s); the child exits; ``bell`` is set 0.1 s after
    the child's last ``atexit`` handler ran, inside its finalization. Before the exit's wait, that
    wait returned then and the thread was ended inside pybind11's GIL guard: exit -6, "terminate
    called without an active exception" (3 of 3 runs). Now the exit wakes the wait and waits
    for it (``WOKEN_S``) first: exit 0, and the exit is not held for the wait's 30 s."""
    proc = subprocess.Popen([sys.executable, str(CHILD), str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        server.wait(["waiting"], timedelta(seconds=60))
        waiting = time.monotonic()
        server.wait(["exiting"], timedelta(seconds=60))  # the child's last atexit handler
        held_s = time.monotonic() - waiting
        time.sleep(0.1)
        server.set("wsync/exit/bell", "1")
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "terminate called" not in out, (proc.returncode, out[-2000:])
    assert held_s < 10.0, f"the exit waited {held_s:.1f} s for the thread's store wait (30 s) instead of waking it"
