"""A torchrun worker that reports what the wsync rendezvous gave it.

Emits ``start`` with its WSYNC_* and torchelastic environment; with ``--store-check``
the trainer's rank 0 writes a greeting on the shared store (``WSYNC_STORE``) and every
worker emits ``store`` with the greeting it reads there; with ``--pg`` it all-reduces
in a gloo group over ``MASTER_ADDR``/``MASTER_PORT``. With ``--hold FILE`` it stays
alive until FILE exists (the test's way to keep a job running). Then ``exit``.
Imports only torch, not lightning_wsync: this checks the rendezvous alone.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

from _report import emit, env_snapshot


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tag", default="")
    parser.add_argument("--hold", type=Path, default=None)
    parser.add_argument("--hold-timeout", type=float, default=150.0)
    parser.add_argument("--store-check", action="store_true")
    parser.add_argument("--pg", action="store_true")
    args = parser.parse_args()
    emit(args.out, "start", tag=args.tag, env=env_snapshot())

    if args.pg:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        total = torch.ones(1)
        dist.all_reduce(total)
        emit(
            args.out,
            "pg",
            tag=args.tag,
            allreduce=float(total.item()),
            world_size=dist.get_world_size(),
        )

    if args.store_check:
        from torch.distributed import TCPStore

        host, _, port = os.environ["WSYNC_STORE"].rpartition(":")
        store = TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=60)
        )
        key = f"probe/{os.environ['WSYNC_JOB']}/trainer"
        if os.environ["WSYNC_ROLE"] == "trainer" and os.environ["RANK"] == "0":
            store.set(key, f"hello from trainer pid {os.getpid()}")
        emit(args.out, "store", tag=args.tag, value=store.get(key).decode())

    if args.hold is not None:
        deadline = time.monotonic() + args.hold_timeout
        while not args.hold.exists():
            if time.monotonic() > deadline:
                emit(args.out, "hold_timeout", tag=args.tag)
                return 3
            time.sleep(0.05)  # polling the test's stop file
    if args.pg:
        import torch.distributed as dist

        dist.destroy_process_group()
    emit(args.out, "exit", tag=args.tag)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
