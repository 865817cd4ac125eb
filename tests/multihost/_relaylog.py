"""What a multi-host scenario's processes log: warnings, and the relay's INFO lines (chains and trees
formed, elections, hops ended, resends) with a time and a thread, so that a failure's logs say which
chain each leader saw and when (the sharded scenario's "h4r0 never joined a hop" left one line)."""

from __future__ import annotations

import faulthandler
import logging
import signal


def relay_info() -> None:
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s")  # fmt: skip
    logging.getLogger("lightning_wsync._planes.relay").setLevel(logging.INFO)
    # Every thread's stack on SIGUSR1 (the scenario's Procs.dump_stacks() on a failure).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
