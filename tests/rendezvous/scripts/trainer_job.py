"""Trainer side of the rendezvous scenario: every rank "trains", rank 0 pushes.

Every step all ranks all-reduce a stop flag raised by rank 0 when ``--stop`` exists,
so all ranks leave the loop at the same step. Every ``--push-every-steps`` steps the
weights move to the next version (identically on every rank, as under DDP) and rank 0
pushes it. On stop, rank 0 pushes one final version, waits for its delivery, closes
the sender, and everyone exits 0.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _report import emit, env_snapshot, make_policy, set_version

from lightning_wsync import WeightSender


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop", type=Path, required=True)
    parser.add_argument("--push-every-steps", type=int, default=5)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--max-s", type=float, default=150.0)
    args = parser.parse_args()

    emit(args.out, "start", env=env_snapshot())
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    model = make_policy()
    version = 0
    set_version(model, version)
    sender = WeightSender(model) if rank == 0 else None
    if sender is not None:
        sender.push(version)
        emit(args.out, "push", version=version)

    deadline = time.monotonic() + args.max_s
    step = 0
    while True:
        stop = torch.tensor(
            [float(rank == 0 and (args.stop.exists() or time.monotonic() > deadline))]
        )
        dist.all_reduce(stop)
        if stop.item() > 0:
            break
        step += 1
        if step % args.push_every_steps == 0:
            version += 1
            set_version(model, version)
            if sender is not None:
                sender.push(version)
                emit(args.out, "push", version=version)
        time.sleep(args.step_s)  # the training step's compute

    version += 1
    set_version(model, version)
    if sender is not None:
        report = sender.push(version).wait(timeout_s=30)
        emit(
            args.out,
            "final",
            version=version,
            delivered=sorted(report.delivered),
            failed=report.failed,
        )
        sender.close()
    dist.destroy_process_group()
    emit(args.out, "exit", version=version)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
