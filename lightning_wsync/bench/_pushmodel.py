"""Fit the relay's push-time model (:mod:`lightning_wsync.testing.pushmodel`) to ``bench --hosts`` results.

::

    python -m lightning_wsync.bench._pushmodel relay4.json relay8.json relay16.json

Prints the fitted per-hop latency and fixed cost of the chain and of the two
complementary trees, and the predicted push time of a chain, of the two trees and of
plain trees of fan-out 2 and 4 (every relay sending the whole version to each child)
for more hosts; the last column is the trees' prediction over one host's.
"""

from __future__ import annotations

import argparse
import json
import sys

from lightning_wsync.testing.pushmodel import Link, fit, fit_trees, push_time, trees_time


def _points(paths: list[str]) -> tuple[list[tuple[int, Link, float]], list[tuple[int, Link, float]]]:
    """(chain points, tree points) from the results' relay, chain and tree phases (one host counts for both)."""
    chain, trees = [], []
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        for name, phase in result["phases"].items():
            link = Link(phase["pushed_bytes"], result["config"]["link_bits_per_s"])
            point = (int(phase["hosts"]), link, float(phase["latency_s"]))
            shape = phase.get("shape", phase["topology"])
            if name == "one_host" and phase["topology"] != "star":
                chain.append(point)
                trees.append(point)
            elif shape == "tree":
                trees.append(point)
            elif shape in ("relay", "chain"):
                chain.append(point)
    return chain, trees


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_wsync.bench._pushmodel")
    parser.add_argument("results", nargs="+", help="bench --hosts --json outputs with relay, chain or tree phases")
    parser.add_argument("--predict", type=int, nargs="*", default=[64, 256, 1024, 4096])
    args = parser.parse_args(argv)
    points, tree_points = _points(args.results)
    if not points:
        print("no relay phase in the results", file=sys.stderr)
        return 1
    hop_s, fixed_s = fit(points)
    print(f"chain fitted: per-hop latency h = {hop_s * 1e3:.1f} ms, fixed cost t0 = {fixed_s:.3f} s")
    tree_hop_s, tree_fixed_s = fit_trees(tree_points) if tree_points else (hop_s, fixed_s)
    if tree_points:
        print(f"trees fitted: per-level latency h_t = {tree_hop_s * 1e3:.1f} ms, fixed cost t0 = {tree_fixed_s:.3f} s")
    lk0 = points[0][1]
    crossover = 1 + (lk0.model_bytes / lk0.rate) / (lk0.chunk_bytes / lk0.rate + hop_s) if hop_s > 0 else float("inf")
    print(f"a chain beats fan-out 2 up to about H* = {crossover:.0f} hosts on these links")
    print(f"{'hosts':>6} {'chain meas s':>12} {'trees meas s':>12} {'chain s':>8} {'trees s':>8} {'f=2 s':>7} "
          f"{'f=4 s':>7} {'trees/1 host':>12}")  # fmt: skip
    measured: dict[int, list[float | None]] = {}
    for hosts, _, t in points:
        measured.setdefault(hosts, [None, None])[0] = t
    for hosts, _, t in tree_points:
        measured.setdefault(hosts, [None, None])[1] = t
    one = trees_time(1, lk0, hop_s=tree_hop_s, fixed_s=tree_fixed_s)
    for hosts in sorted(measured) + [h for h in args.predict if h not in measured]:
        chain_m, tree_m = measured.get(hosts, [None, None])
        row = [push_time(hosts, lk0, hop_s=hop_s, fixed_s=fixed_s, fanout=f) for f in (1, 2, 4)]
        tree = trees_time(hosts, lk0, hop_s=tree_hop_s, fixed_s=tree_fixed_s)
        cells = ["-" if m is None else f"{m:.2f}" for m in (chain_m, tree_m)]
        print(f"{hosts:>6} {cells[0]:>12} {cells[1]:>12} {row[0]:>8.2f} {tree:>8.2f} {row[1]:>7.2f} {row[2]:>7.2f} "
              f"{tree / one:>12.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
