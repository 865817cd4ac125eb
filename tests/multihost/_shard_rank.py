"""Trainer rank 1 of a sharded push, on a simulated host of its own (see sharded_across_hosts.py).

It does what the callback does on a rank other than 0, with the store standing in for the
gloo collectives: makes its share's ring, publishes the ring's name and its host
(``xs/<launch>/rank1``), waits for rank 0's sender epoch (``xs/<launch>/epoch``), relays its share
(:meth:`ShareWriter.relay`), then for the n-th ask ``xs/<launch>/push/<n>`` = v writes version v
of its share and answers ``xs/<launch>/wrote/<v>``. ``v = 0`` ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _relaylog import relay_info

from lightning_wsync import SenderConfig
from lightning_wsync._control.host import host_id
from lightning_wsync._planes.shares import ShareWriter
from lightning_wsync._push.shares import prepare_shares
from lightning_wsync.testing.models import build_model, mutate, spec_for_size, touch


def main() -> int:
    relay_info()
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--launch", required=True)
    parser.add_argument("--size-mb", type=float, required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--delta", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(1)
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120))
    prefix = f"xs/{args.launch}/"
    model = build_model(spec_for_size(args.size_mb), seed=0)
    cfg = SenderConfig(job=args.job, timeout_s=args.timeout_s, heartbeat_timeout_s=6.0, delta=args.delta)
    change = touch if args.delta == "always" else mutate  # a sparse step where the test wants deltas
    writer = ShareWriter(prepare_shares(model, cfg, 1, 2), cfg)
    try:
        store.set(prefix + "rank1", json.dumps({"name": writer.name, "host": host_id(), "pid": os.getpid()}))
        writer.relay(args.store, int(store.get(prefix + "epoch")), cfg)
        mutated = asked = 0
        while (version := int(store.get(f"{prefix}push/{asked + 1}"))) > 0:
            asked += 1
            for step in range(mutated + 1, version + 1):  # the same steps as rank 0's replica
                change(model, step)
            mutated = version
            store.set(f"{prefix}wrote/{version}", "1" if writer.write(version) else "0")
    finally:
        started = time.monotonic()
        writer.close()
        # The scenario waits 30 s for this process to end: its log says where that time went.
        print(f"rank 1: writer closed in {time.monotonic() - started:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
