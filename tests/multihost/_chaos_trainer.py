"""The trainer of relay_chaos.py's ``trainer`` mode, a process of its own (SIGKILLed and relaunched).

It rebuilds the model at version ``--first - 1`` (the steps are deterministic: a relaunched
trainer holds, bit for bit, what the one before held), then pushes ``--first`` .. ``--last``
one every INTERVAL_S to the store the scenario hosts, writing a line per push to ``--pushed``,
once ``--go`` exists (every receiver registered). Before the last push it waits for
``--go-last`` (the names every live receiver has) and for all of them to be live in its
membership, so the last version goes to everyone; it writes that push's report to
``--report`` and closes when ``--close`` appears.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from _relay_receiver import emit
from relay_chaos import HEARTBEAT_TIMEOUT_S, INTERVAL_S, SPEC, TIMEOUT_S, step

from lightning_wsync import WeightSender
from lightning_wsync.testing.models import build_model


def wait_for(what: str, condition: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"trainer: timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser()
    for name in ("--store", "--pushed", "--go", "--go-last", "--report", "--close", "--cross-host"):
        parser.add_argument(name, required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--last", type=int, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("lightning_wsync._planes.relay").setLevel(logging.INFO)
    torch.set_num_threads(1)
    model = build_model(SPEC, seed=0)
    for version in range(1, args.first):
        step(model, version)
    with WeightSender(model, store=args.store, job="chaos", timeout_s=TIMEOUT_S,
                      heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, delta="auto",
                      cross_host=args.cross_host) as sender:  # fmt: skip
        emit(args.pushed, event="started", pid=os.getpid(), epoch=sender.epoch, first=args.first)
        wait_for("the go (every receiver registered)", Path(args.go).exists, 300)  # a relaunch: there already
        for version in range(args.first, args.last + 1):
            if version == args.last:
                go_last = Path(args.go_last)
                wait_for("the go for the last push", go_last.exists, 300)
                names = set(json.loads(go_last.read_text()))
                wait_for(f"{sorted(names)} to be live", lambda n=names: n <= set(sender.receivers()), 180)
            step(model, version)
            handle = sender.push(version)
            emit(args.pushed, event="pushed", version=version, t=time.time(), epoch=sender.epoch)
            if version < args.last:
                time.sleep(INTERVAL_S)  # the push rate (no wait on the receivers: they may be stopped)
        report = handle.wait(TIMEOUT_S)
        Path(args.report).write_text(json.dumps({"delivered": sorted(report.delivered), "failed": report.failed,
                                                 "delta_receivers": sorted(report.delta_receivers)}))  # fmt: skip
        wait_for("the scenario's close", Path(args.close).exists, 600)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
