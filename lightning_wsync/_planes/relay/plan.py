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
(``cross_host="relay"``; ``"chain"`` and ``"tree"`` force one), on the wire size of a
version as it travels (:func:`delta_chunks_s`: full, or the last delta's share).
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
# h_t = 87 ms), so the trees take over from ~22 hosts. Not refitted for the relay's 1 MiB
# chunks (hops.CHUNK_BYTES since 2026-11-29): at 16 hosts x 1 a chain hop then cost 14-15 ms
# in all against 19-24 ms with 512 KiB, a tree level 91 ms against 111 ms (one run each,
# docs/benchmarks.md "1 MiB chunks"), so the chain's lead there grew; the crossover, and
# deltas' (whose chain pieces stay 512 KiB), were not measured again.
CHUNK_WIRE_S = 0.006
CHUNK_BYTES = 1 << 19  # the chunk the model was fitted with, and a chain delta record piece
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


def pipeline_s(
    hosts: int, *, chunk_s: float = CHUNK_WIRE_S, hop_s: float = HOP_S, level_s: float = TREE_LEVEL_S,
    tree_chunk_s: float | None = None,
) -> tuple[float, float]:  # fmt: skip
    """What the model puts on top of one wire time at ``hosts`` leaders: (chain, trees).

    ``chunk_s`` is the wire time of the unit a leader forwards on a chain (a chunk, or a
    piece of a delta's record), ``tree_chunk_s`` that of a tree's unit (``chunk_s`` when
    None; with deltas, one chunk's record, far smaller than a chain's record piece)."""
    tree_chunk_s = chunk_s if tree_chunk_s is None else tree_chunk_s
    return (hosts - 1) * (chunk_s + hop_s), (tree_depth(hosts) - 1) * (2 * tree_chunk_s + level_s)


def prefer_tree(hosts: int, *, chunk_s: float = CHUNK_WIRE_S, hop_s: float = HOP_S,
                level_s: float = TREE_LEVEL_S, tree_chunk_s: float | None = None) -> bool:  # fmt: skip
    """Whether the model puts the trees ahead of the chain at ``hosts`` leaders."""
    chain, tree = pipeline_s(hosts, chunk_s=chunk_s, hop_s=hop_s, level_s=level_s, tree_chunk_s=tree_chunk_s)
    return tree < chain


def delta_chunks_s(wire_share: float, bucket_bytes: float) -> tuple[float, float]:
    """The forwarded units' wire times (chain, trees) when a version travels as ``wire_share``
    of its bytes: a chain's delta is a record per bucket of ``bucket_bytes`` forwarded in
    pieces of up to a chunk; a tree's is a record per chunk."""
    share = min(1.0, max(0.0, wire_share))
    return CHUNK_WIRE_S * min(1.0, share * bucket_bytes / CHUNK_BYTES), CHUNK_WIRE_S * share


SWITCH_MARGIN = 0.1  # the topology in use is kept unless the other one is this much faster


def choose_tree(hosts: int, *, wire_share: float, bucket_bytes: float, current: bool | None) -> bool:
    """The model's choice at ``hosts`` leaders for versions that travel as ``wire_share`` of their
    bytes (1.0: in full). ``current``: the topology in use at this host count (None: none, or the
    host count changed), kept unless the other wins by SWITCH_MARGIN, as the share moves a little
    with every version."""
    chain_chunk_s, tree_chunk_s = delta_chunks_s(wire_share, bucket_bytes)
    chain, tree = pipeline_s(hosts, chunk_s=chain_chunk_s, tree_chunk_s=tree_chunk_s)
    if current is None:
        return tree < chain
    if current:
        return not chain < tree * (1 - SWITCH_MARGIN)
    return tree < chain * (1 - SWITCH_MARGIN)
