"""A receiver process on a simulated host: applies every version it can, reports each with its digest."""

from __future__ import annotations

import argparse
import json
import os

import torch

from lightning_wsync import WeightReceiver, WeightSyncClosedError
from lightning_wsync.bench._model import build_model, digest, spec_for_size


def emit(path: str, **fields: object) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(fields) + "\n").encode())
    finally:
        os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--size-mb", type=float, required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model(spec_for_size(args.size_mb), seed=None)
    with WeightReceiver(
        model, store=args.store, job=args.job, name=args.name, timeout_s=args.timeout_s
    ) as receiver:
        emit(
            args.events,
            event="ready",
            name=args.name,
            pid=os.getpid(),
            rid=receiver.rid,
        )
        held = -1
        while True:
            try:
                held = receiver.wait_for_version(held + 1, timeout_s=args.timeout_s)
            except WeightSyncClosedError:
                return 0
            emit(args.events, event="applied", name=args.name, pid=os.getpid(), version=held,
                 digest=digest(model, None))  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
