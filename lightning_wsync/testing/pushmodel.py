"""A model of push time across hosts through the relay, to calibrate on ``bench --hosts`` results.

``python -m lightning_wsync.bench._pushmodel RESULT.json ...`` fits it and prints predictions.

For a chain of H host leaders (fan-out f = 1) or a tree of fan-out f, with model bytes
S, chunk bytes c, effective link rate B (tc tbf delivers ~96% of the configured rate),
per-hop latency h (fixed cost a chunk pays at each hop: socket, copy, scheduling) and a
fixed cost t0 (snapshot, announcement, the last host's verification and apply)::

    depth(H, f) = H                       for f = 1 (a chain)
                = ceil(log_f(H (f - 1) + 1))  for f > 1 (complete f-ary tree)
    T(H, f)     = t0 + f S / B + (depth - 1) (f c / B + h)      (f capped at H)

A chain beats fan-out f while (H - 1)(c/B + h) < (f - 1) S/B + ..., i.e. up to about
H* = 1 + (f - 1) (S/B) / (c/B + h) hosts.

Each relay sends f copies, so its link carries f S per version: fan-out trades f - 1
extra wire times for fewer hops. With a failure rate p (probability that a given host's
leader dies or stalls during a push) the expected time adds the cost of repairing the
chain: ``(1 - (1 - p)^H) * r``, with r the repair time (``timeout_s`` for a stall, the
re-attach time for a crash). ``h`` and ``t0`` are fitted by least squares to the measured
relay latencies (``latency_s`` of each result's relay phase).

The relay's two complementary binary trees (``cross_host="tree"``, see
:mod:`lightning_wsync._planes.relay.plan`) carry half of every version each, so every
link carries one model, and a chunk waits at each level for its send to two children::

    T_trees(H) = t0 + S / B + (floor(log2 H)) (2 c / B + h_t)

``h_t`` and ``t0`` are fitted on the tree phases (:func:`fit_trees`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_wsync._planes.relay.hops import CHUNK_BYTES
from lightning_wsync._planes.relay.plan import prefer_tree, tree_depth

__all__ = [
    "TBF_EFFICIENCY", "Link", "depth", "fit", "fit_trees", "prefer_tree", "push_time", "tree_depth", "trees_time",
]  # fmt: skip

TBF_EFFICIENCY = 0.96


@dataclass(frozen=True)
class Link:
    model_bytes: float
    link_bits_per_s: float
    chunk_bytes: float = float(CHUNK_BYTES)

    @property
    def rate(self) -> float:
        return self.link_bits_per_s * TBF_EFFICIENCY / 8


def depth(hosts: int, fanout: int) -> int:
    if fanout == 1:
        return hosts
    return max(1, math.ceil(math.log(hosts * (fanout - 1) + 1, fanout)))


def push_time(
    hosts: int, link: Link, *, hop_s: float, fixed_s: float, fanout: int = 1, failure_rate: float = 0.0,
    repair_s: float = 0.0,
) -> float:  # fmt: skip
    d = depth(hosts, fanout)
    f = min(fanout, hosts)  # a relay never sends more copies than it has children
    t = fixed_s + f * link.model_bytes / link.rate + (d - 1) * (f * link.chunk_bytes / link.rate + hop_s)
    return t + (1 - (1 - failure_rate) ** hosts) * repair_s


def fit(points: list[tuple[int, Link, float]]) -> tuple[float, float]:
    """Least-squares (hop_s, fixed_s) for a chain from (hosts, link, measured latency)."""
    xs = [h - 1 for h, _, _ in points]
    ys = [t - lk.model_bytes / lk.rate - (h - 1) * lk.chunk_bytes / lk.rate for h, lk, t in points]
    n = len(points)
    if n == 1 or len(set(xs)) == 1:
        return 0.0, sum(ys) / n
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, slope), my - max(0.0, slope) * mx


def trees_time(hosts: int, link: Link, *, hop_s: float, fixed_s: float) -> float:
    """Push time through the two complementary binary trees."""
    levels = tree_depth(hosts) - 1
    return fixed_s + link.model_bytes / link.rate + levels * (2 * link.chunk_bytes / link.rate + hop_s)


def fit_trees(points: list[tuple[int, Link, float]]) -> tuple[float, float]:
    """Least-squares (hop_s, fixed_s) for the trees from (hosts, link, measured latency)."""
    xs = [tree_depth(h) - 1 for h, _, _ in points]
    ys = [t - lk.model_bytes / lk.rate - (tree_depth(h) - 1) * 2 * lk.chunk_bytes / lk.rate for h, lk, t in points]
    n = len(points)
    if n == 1 or len(set(xs)) == 1:
        return 0.0, sum(ys) / n
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, slope), my - max(0.0, slope) * mx
