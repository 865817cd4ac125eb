"""Pieces of the relay that need no hosts: chunking, the push-time model, the setting."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_wsync import WeightSender
from lightning_wsync._control.manifest import build_manifest
from lightning_wsync._control.records import ChainRecord
from lightning_wsync._planes.relay.hops import (
    CHUNK_ALIGN,
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    TAIL_BYTES,
    chunk_bytes,
    chunks,
)
from lightning_wsync._planes.relay.plan import HEAD, half, prefer_tree, roots, tree_depth, tree_links
from lightning_wsync.config import SenderConfig
from lightning_wsync.testing.pushmodel import Link, depth, fit, push_time


def test_chunks_cover_every_byte_once_and_never_straddle_a_bucket() -> None:
    tensors = {f"t{i}": torch.zeros(n) for i, n in enumerate([3, 700_000, 5, 1_200_000, 17])}
    layout = build_manifest(tensors, None, 2 * 2**20)
    pieces = chunks(layout)
    assert pieces[0][0] == 0 and pieces[-1][1] == layout.total_bytes
    assert all(b == a2 for (_, b, _), (a2, _, _) in itertools.pairwise(pieces))
    for a, b, bucket in pieces:
        ba, bb = layout.buckets[bucket]
        assert ba <= a < b <= bb and b - a <= CHUNK_BYTES
    assert pieces[-1][1] - pieces[-1][0] <= TAIL_BYTES  # the last piece crosses each hop quickly


def test_chunks_grow_with_the_version_within_bounds() -> None:
    mib = 2**20
    assert chunk_bytes(1000) == chunk_bytes(64 * mib) == chunk_bytes(128 * mib) == CHUNK_BYTES == mib
    assert chunk_bytes(256 * mib) == 2 * mib and chunk_bytes(160 * mib) == 1280 * 1024
    assert chunk_bytes(10 * 2**30) == MAX_CHUNK_BYTES == 4 * mib
    assert all(chunk_bytes(n) % CHUNK_ALIGN == 0 for n in range(0, 1 << 30, 7_777_777))
    # A 160 MiB layout: chunks of 1.25 MiB cover it once, never straddle a bucket, end in a short piece.
    layout = build_manifest({"a": torch.zeros(3), "b": torch.zeros(160 * mib // 4 - 8), "c": torch.zeros(5)}, None,
                            32 * mib)  # fmt: skip
    pieces = chunks(layout)
    assert pieces[0][0] == 0 and pieces[-1][1] == layout.total_bytes
    assert all(b == a2 for (_, b, _), (a2, _, _) in itertools.pairwise(pieces))
    size = chunk_bytes(layout.total_bytes)
    assert size > CHUNK_BYTES
    for a, b, bucket in pieces:
        ba, bb = layout.buckets[bucket]
        assert ba <= a < b <= bb and b - a <= size
    assert max(b - a for a, b, _ in pieces) == size
    assert pieces[-1][1] - pieces[-1][0] <= TAIL_BYTES


def test_push_time_model() -> None:
    link = Link(model_bytes=64 * 2**20, link_bits_per_s=700e6)
    wire = link.model_bytes / link.rate
    assert depth(8, 1) == 8 and depth(1, 2) == 1 and depth(7, 2) == 3 and depth(4096, 4) == 7
    assert push_time(1, link, hop_s=0.01, fixed_s=0.1) == pytest.approx(0.1 + wire)
    assert push_time(1, link, hop_s=0.01, fixed_s=0.1, fanout=4) == pytest.approx(0.1 + wire)
    chain = push_time(8, link, hop_s=0.01, fixed_s=0.1)
    assert chain == pytest.approx(0.1 + wire + 7 * (CHUNK_BYTES / link.rate + 0.01))
    assert push_time(8, link, hop_s=0.01, fixed_s=0.1, fanout=2) > chain  # two wire times per relay
    assert push_time(8, link, hop_s=0.01, fixed_s=0.1, failure_rate=1.0, repair_s=30) == pytest.approx(chain + 30)
    points = [(h, link, push_time(h, link, hop_s=0.02, fixed_s=0.15)) for h in (2, 4, 8, 16)]
    hop_s, fixed_s = fit(points)
    assert hop_s == pytest.approx(0.02) and fixed_s == pytest.approx(0.15)


def test_cross_host_setting_is_validated() -> None:
    assert SenderConfig().cross_host == "relay"
    choices = r"\('relay', 'chain', 'tree', 'star'\)"
    with pytest.raises(ValueError, match=rf"cross_host='ring' is unknown; choose one of {choices}"):
        WeightSender(torch.nn.Linear(2, 2), store="127.0.0.1:0", job="j", cross_host="ring")


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 16, 24])
def test_two_trees_reach_every_leader_once_each_and_no_leader_is_inner_in_both(n: int) -> None:
    rids = tuple(range(100, 100 + n))
    links = {r: tree_links(rids, r) for r in rids}
    for t in (0, 1):
        root = roots(rids)[t]
        assert links[root].parents[t] == HEAD
        assert sorted(c for r in rids for c in links[r].children[t]) == sorted(set(rids) - {root})  # each once
        for r in rids:
            assert all(links[c].parents[t] == r for c in links[r].children[t])
            steps, at = 0, r
            while at != HEAD:  # every leader is reached from the root within the heap's depth
                at, steps = links[at].parents[t], steps + 1
            assert steps <= tree_depth(n)
    for r in rids:  # one tree's children at most: each leader sends at most one half twice (one model)
        assert sum(1 for t in (0, 1) if links[r].children[t]) <= 1
        assert all(len(links[r].children[t]) <= 2 for t in (0, 1))
    assert tree_depth(16) == 5 and tree_depth(1) == 1


def test_the_two_halves_split_the_pieces_alternately() -> None:
    assert half(5, 0) == [0, 2, 4] and half(5, 1) == [1, 3] and half(1, 1) == []


def test_the_model_prefers_a_chain_for_few_hosts_and_trees_for_many() -> None:
    assert not any(prefer_tree(h) for h in (1, 2, 4, 8, 16, 21))  # as fitted on simulated hosts
    assert all(prefer_tree(h) for h in (24, 64, 4096))
    assert prefer_tree(8, hop_s=0.013, level_s=0.013)  # a tree level that costs a chain hop: trees from ~5 hosts


def test_the_chain_record_says_whether_it_is_two_trees() -> None:
    assert ChainRecord.decode({"number": 3, "rids": [1, 2]}) == ChainRecord(3, (1, 2), False)  # older senders
    assert ChainRecord.decode(ChainRecord(4, (2, 9), True).encode()) == ChainRecord(4, (2, 9), True)
