"""Rollout side of the rendezvous scenario: hold the newest version, verify it bit-exact.

Emits ``applied`` for each version applied (with whether the module holds exactly the
trainer's weights of that version) and, when the sender closes, ``final`` with the
version held, then exits 0. With ``--exit-after-version V`` it exits 0 once it holds V
or newer. With ``--pg`` it first all-reduces in a gloo group of the whole rollout job
(over ``MASTER_ADDR``/``MASTER_PORT``), which must work after restarts and scale-up.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _report import emit, env_snapshot, holds_version, make_policy


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tag", default="")
    parser.add_argument("--exit-after-version", type=int, default=None)
    parser.add_argument("--pg", action="store_true")
    args = parser.parse_args()

    emit(args.out, "start", tag=args.tag, env=env_snapshot())
    if args.pg:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        total = torch.ones(1)
        dist.all_reduce(total)
        emit(
            args.out,
            "pg",
            tag=args.tag,
            world_size=dist.get_world_size(),
            allreduce=total.item(),
        )
        dist.destroy_process_group()

    # Imported only now, so that the workers of a new group reach init_process_group
    # close together: that is when stale addresses in a reused bootstrap store bite.
    from lightning_wsync import WeightReceiver, WeightSyncClosedError

    model = make_policy()
    with WeightReceiver(model, timeout_s=60) as receiver:
        held = -1
        while True:
            try:
                held = receiver.wait_for_version(held + 1, timeout_s=60)
            except WeightSyncClosedError:
                version = receiver.version
                exact = version is not None and holds_version(model, version)
                emit(args.out, "final", tag=args.tag, version=version, exact=exact)
                return 0
            emit(
                args.out,
                "applied",
                tag=args.tag,
                version=held,
                exact=holds_version(model, held),
            )
            if args.exit_after_version is not None and held >= args.exit_after_version:
                emit(args.out, "exit", tag=args.tag, version=held)
                return 0
            time.sleep(0.01)  # the rollout's own work between updates


if __name__ == "__main__":
    raise SystemExit(main())
