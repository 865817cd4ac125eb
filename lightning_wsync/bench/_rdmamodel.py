"""Print the RDMA push-time model's predictions (:mod:`lightning_wsync.testing.rdmamodel`).

::

    python -m lightning_wsync.bench._rdmamodel

One row per model, GPU count and NIC rate: seconds until every engine GPU holds the
version with full versions, with deltas of 3% changed words on this package's CPU codec,
and with the same deltas on a GPU codec (not built); the tree levels and one share's bytes.
"""

from __future__ import annotations

import argparse

from lightning_wsync.testing.rdmamodel import (
    PEERS,
    Model,
    Rdma,
    delta_push_s,
    full_push_s,
    gpu_codec,
    levels,
    share_bytes,
)

MODELS = (
    Model("70B", 70e9, gpus_per_engine=8),
    Model("235B", 235e9, gpus_per_engine=8),
    Model("1T", 1e12, gpus_per_engine=32),  # 2 TB in bf16 needs 4 hosts of 8 x 80 GB
)

# Delta bytes over full bytes at 3% changed words: the codec's measured ratio of wire bytes to
# changed words is ~0.6 (docs/benchmarks.md, "Delta pushes": 2.0-3.9% on the wire for 3.3-7.4%
# of words changed, bf16), so 3% changed words is ~1.8% of the full version on the wire.
WIRE_AT_3PCT = 0.018


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_wsync.bench._rdmamodel")
    parser.add_argument("--gpus", type=int, nargs="*", default=[1000, 4096])
    parser.add_argument("--nic-gbit", type=float, nargs="*", default=[200.0, 400.0])
    parser.add_argument("--wire-fraction", type=float, default=WIRE_AT_3PCT)
    args = parser.parse_args(argv)
    print(f"{'model':>5} {'GPUs':>5} {'NIC':>8} {'share GB':>8} {'levels':>6} {'full s':>7} "
          f"{'delta cpu s':>11} {'delta gpu s':>11}")  # fmt: skip
    for model in MODELS:
        for gpus in args.gpus:
            for gbit in args.nic_gbit:
                rdma = Rdma(nic_gbit_s=gbit)
                full = full_push_s(model, gpus, rdma)
                cpu = delta_push_s(model, gpus, rdma, wire_fraction=args.wire_fraction)
                gpu = delta_push_s(model, gpus, gpu_codec(rdma), wire_fraction=args.wire_fraction)
                print(f"{model.name:>5} {gpus:>5} {gbit:>5.0f} Gb {share_bytes(model) / 1e9:>8.1f} "
                      f"{levels(gpus, model):>6} {full:>7.2f} {cpu:>11.2f} {gpu:>11.2f}")  # fmt: skip
    print()
    for who, what, took in PEERS:
        print(f"  {who}: {what} in {took}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
