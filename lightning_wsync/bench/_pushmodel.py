"""Fit the relay's push-time model (:mod:`lightning_wsync.testing.pushmodel`) to ``bench --hosts`` results.

::

    python -m lightning_wsync.bench._pushmodel relay4.json relay8.json relay16.json

Prints the fitted per-hop latency and fixed cost, the chain's crossover against a tree,
and the predicted push time of a chain and of trees of fan-out 2 and 4 for more hosts.
"""

from __future__ import annotations

import argparse
import json
import sys

from lightning_wsync.testing.pushmodel import Link, fit, push_time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_wsync.bench._pushmodel")
    parser.add_argument("results", nargs="+", help="bench --hosts --json outputs with a relay phase")
    parser.add_argument("--predict", type=int, nargs="*", default=[64, 256, 1024, 4096])
    args = parser.parse_args(argv)
    points = []
    for path in args.results:
        with open(path) as f:
            result = json.load(f)
        for phase in result["phases"].values():
            if phase["topology"] == "relay":
                link = Link(phase["pushed_bytes"], result["config"]["link_bits_per_s"])
                points.append((int(phase["hosts"]), link, float(phase["latency_s"])))
    if not points:
        print("no relay phase in the results", file=sys.stderr)
        return 1
    hop_s, fixed_s = fit(points)
    print(f"fitted: per-hop latency h = {hop_s * 1e3:.1f} ms, fixed cost t0 = {fixed_s:.3f} s")
    lk0 = points[0][1]
    crossover = 1 + (lk0.model_bytes / lk0.rate) / (lk0.chunk_bytes / lk0.rate + hop_s) if hop_s > 0 else float("inf")
    print(f"a chain beats fan-out 2 up to about H* = {crossover:.0f} hosts on these links")
    print(f"{'hosts':>6} {'measured s':>11} {'chain s':>8} {'tree f=2 s':>11} {'tree f=4 s':>11}")
    link = points[0][1]
    for hosts, lk, measured in sorted(points, key=lambda p: p[0]):
        row = [push_time(hosts, lk, hop_s=hop_s, fixed_s=fixed_s, fanout=f) for f in (1, 2, 4)]
        print(f"{hosts:>6} {measured:>11.2f} {row[0]:>8.2f} {row[1]:>11.2f} {row[2]:>11.2f}")
    for hosts in args.predict:
        row = [push_time(hosts, link, hop_s=hop_s, fixed_s=fixed_s, fanout=f) for f in (1, 2, 4)]
        print(f"{hosts:>6} {'-':>11} {row[0]:>8.2f} {row[1]:>11.2f} {row[2]:>11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
