"""``lightning-wsync store``: a standalone control-plane TCPStore.

Host the store in its own process so that trainer and rollout jobs can outlive each
other; pass ``--rdzv-conf is_host=false`` to both::

    lightning-wsync store --host 0.0.0.0 --port 29400

It prints ``lightning-wsync store listening on HOST:PORT`` once it serves (with
``--port 0`` the port is picked free and printed), and exits 0 on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from types import FrameType

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``store`` subcommand's options to ``parser``."""
    parser.add_argument(
        "--host",
        default="0.0.0.0",
        help="address the jobs use to reach the store (default: %(default)s)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=29400,
        help="port to listen on; 0 picks a free one and prints it (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    """Host the store until SIGINT or SIGTERM; return 0.

    Returns:
        The exit status: 0 after a signal, 1 when the port cannot be bound.
    """
    from lightning_wsync._control.store import tcp_store

    host: str = args.host
    port: int = args.port
    if not 0 <= port < 2**16:
        raise ValueError(
            f"lightning-wsync store: --port {port!r} is not a TCP port; use 0-65535."
        )
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {
        sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        try:
            store = tcp_store(host, port, serve=True, timeout_s=60)
        except RuntimeError as exc:
            print(
                f"lightning-wsync store: cannot listen on {host}:{port}: {exc}",
                file=sys.stderr,
            )
            return 1
        print(f"lightning-wsync store listening on {host}:{store.port}", flush=True)
        # Event.wait in slices: a signal handler runs only between bytecodes.
        while not stop.wait(0.5):
            pass
        print("lightning-wsync store: stopping", flush=True)
        del store
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
