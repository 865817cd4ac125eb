"""A child for ``test_store_exit.py``: a daemon thread left in a blocking store wait when the
process ends through ``sys.exit``, the key set by the test while this interpreter finalizes.

``python _store_wait_at_exit.py PORT``: joins the test's store, starts a thread in
``Control.wait_for`` (a connection of its own, as a relay leader's bell waits), then exits. Its
last ``atexit`` handler (registered before the library is imported, so it runs after the
library's) sets ``exiting``; the test, waiting for that key, sets the awaited one about 0.1 s
later: the interpreter is then finalizing (about 1 CPU-s with torch loaded).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from datetime import timedelta

import torch.distributed as dist

port = int(sys.argv[1])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
atexit.register(lambda: store.set("exiting", str(os.getpid())))  # the last handler to run

from lightning_wsync._control.store import Control  # noqa: E402 - after the handler above

waiter = Control(store, "exit").clone()
started = threading.Event()


def wait() -> None:
    started.set()
    waiter.wait_for("bell", 30.0)


threading.Thread(target=wait, name="wsync-test-bell", daemon=True).start()
started.wait()
store.set("waiting", "1")
sys.exit(0)
