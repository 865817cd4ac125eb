"""The relay's shapes: a chain of host leaders, or two complementary binary trees.

::

    tree 0 (even chunks)            tree 1 (odd chunks)
          trainer                         trainer
            r0                              r3
          r1  r2                          r4  r5
         r3 r4 r5                        r0 r1 r2

With H leaders in the order ``rids``, tree 0 is the binary heap over ``rids`` and tree 1
the binary heap over ``rids`` rotated by H // 2, so the inner nodes of tree 0 (the first
H // 2) are leaves of tree 1 and the inner nodes of tree 1 are leaves of tree 0 (NCCL's
double binary tree). The trainer sends half of every version (the even chunks) to the
root of tree 0 and the other half to the root of tree 1: its egress stays one model.
Each leader receives each half once (one model in) and forwards one half to at most two
children in the one tree where it is inner (at most one model out), so every link
carries at most one model per version both ways, and a version crosses
``floor(log2 H) + 1`` levels instead of H hops.

:func:`prefer_tree` is the push-time model's choice between the two at a host count
(``cross_host="relay"``; ``"chain"`` and ``"tree"`` force one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HEAD = -1  # a tree's parent that is the sender itself
TREES = 2

# The push-time model (docs/benchmarks.md, "Model of push time"): on top of one wire time a
# chain pays (H - 1) (c/B + h) and the trees (depth - 1) (2 c/B + h_t). The defaults are
# fitted on simulated hosts (700 Mbit/s links, 512 KiB chunks: c/B ~ 6 ms; 1-16 hosts on
# a shared 2-core machine, where a tree level cost far more than a chain hop: h = 13 ms,
# h_t = 87 ms), so the trees take over from ~22 hosts.
CHUNK_WIRE_S = 0.006
HOP_S = 0.013
TREE_LEVEL_S = 0.087


@dataclass(frozen=True)
class TreeLinks:
    """One leader's place in both trees: its parent in each (a rid, or HEAD) and its children."""

    parents: tuple[int, int]
    children: tuple[tuple[int, ...], tuple[int, ...]]


def tree_order(rids: tuple[int, ...], tree: int) -> tuple[int, ...]:
    """The heap order of ``tree``: node i's children are nodes 2i + 1 and 2i + 2."""
    shift = 0 if tree == 0 else len(rids) // 2
    return rids[shift:] + rids[:shift]


def tree_links(rids: tuple[int, ...], rid: int) -> TreeLinks:
    """Where leader ``rid`` sits in the two trees over ``rids``."""
    parents: list[int] = []
    children: list[tuple[int, ...]] = []
    n = len(rids)
    for tree in range(TREES):
        order = tree_order(rids, tree)
        i = order.index(rid)
        parents.append(HEAD if i == 0 else order[(i - 1) // 2])
        children.append(tuple(order[c] for c in (2 * i + 1, 2 * i + 2) if c < n))
    return TreeLinks((parents[0], parents[1]), (children[0], children[1]))


def roots(rids: tuple[int, ...]) -> tuple[int, int]:
    """The leaders the sender feeds: the root of tree 0 and of tree 1."""
    return tree_order(rids, 0)[0], tree_order(rids, 1)[0]


def half(pieces: int, tree: int) -> list[int]:
    """The indices of the version's pieces that travel in ``tree``: every other one, so the
    two halves progress through the buckets together (a bucket is hashed in order)."""
    return list(range(tree, pieces, TREES))


def tree_depth(hosts: int) -> int:
    """Levels of a binary heap of ``hosts`` nodes."""
    return max(1, math.floor(math.log2(max(1, hosts))) + 1)


def prefer_tree(hosts: int, *, chunk_s: float = CHUNK_WIRE_S, hop_s: float = HOP_S,
                level_s: float = TREE_LEVEL_S) -> bool:  # fmt: skip
    """Whether the model puts the trees ahead of the chain at ``hosts`` leaders."""
    chain = (hosts - 1) * (chunk_s + hop_s)
    tree = (tree_depth(hosts) - 1) * (2 * chunk_s + level_s)
    return tree < chain
