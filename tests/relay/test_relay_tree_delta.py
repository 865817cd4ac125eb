"""A tree's halves as deltas over real gloo pairs (both ranks in this process): a leader rebuilds
the version bit-exact whichever kind each tree's edge carries, and refuses a delta on a base it lacks."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_wsync._control.manifest import Manifest, build_manifest, checksum
from lightning_wsync._planes.delta.encode import AutoPolicy, DeltaStream, DeltaStreams
from lightning_wsync._planes.delta.wire import DeltaStats, Held, held_of
from lightning_wsync._planes.relay.hops import chunks, hop_header
from lightning_wsync._planes.relay.leader.hop import HopReceiver
from lightning_wsync._planes.relay.leader.treehop import TreeHop
from lightning_wsync._planes.relay.plan import choose_tree, delta_chunks_s, half, pipeline_s
from lightning_wsync._planes.relay.treedelta import chunk_layout, half_messages, send_halves
from lightning_wsync._planes.wire import DELTA, FULL, Interruptible, PeerGroup, make_group, trailer_words
from lightning_wsync.testing.stores import host_store

pytestmark = pytest.mark.timeout(60)


def _layout() -> Manifest:
    tensors = {f"w{i}": torch.zeros(1_400_000 + 999 * i, dtype=torch.float32) for i in range(3)}  # ~8 relay chunks
    return build_manifest(tensors, torch.bfloat16, bucket_bytes=1 << 20)


def _versions(layout: Manifest) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8, generator=gen)
    new = base.clone()
    words = new.view(torch.int16)
    picked = torch.randint(0, words.numel(), (words.numel() // 25,), generator=gen)
    words[picked] ^= 1  # ~4% of the bf16 words change
    return base, new


def _sums(layout: Manifest, buffer: torch.Tensor) -> list[int]:
    return [checksum(buffer, a, b) for a, b in layout.buckets]


def _pairs(n: int) -> tuple[list[PeerGroup], list[PeerGroup]]:
    """``n`` two-rank gloo groups: (rank 0 sides, rank 1 sides)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = host_store("127.0.0.1", port, timeout_s=20)
    sides: dict[tuple[int, int], PeerGroup] = {}

    def build(t: int, rank: int) -> None:  # a store client each: a blocking get holds its client
        store = server if rank == 0 and t == 0 else dist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=20))
        sides[t, rank] = make_group("gloo", dist.PrefixStore(f"t{t}/", store), rank, "127.0.0.1", 20)

    threads = [threading.Thread(target=build, args=(t, r)) for t in range(n) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return [sides[t, 0] for t in range(n)], [sides[t, 1] for t in range(n)]


def _send(pgs: list[PeerGroup], layout: Manifest, new: torch.Tensor, streams: list[DeltaStream | None]) -> None:
    """The sender's side of one version: tree t in full, or as ``streams[t]``."""
    pieces = chunks(layout)
    halves = [half(len(pieces), t) for t in range(2)]
    for t, pg in enumerate(pgs):
        kind = FULL if streams[t] is None else DELTA
        pg.send([hop_header(7, 3, layout, kind, len(halves[t]))], 1, 0).wait()
    send_halves(pgs, [half_messages(new, pieces, halves[t], streams[t]) for t in range(2)], lambda: None,
                lambda t: None)  # fmt: skip
    trailer = torch.full((trailer_words(len(layout.buckets)),), 3, dtype=torch.int64)
    for pg in pgs:
        pg.send([trailer], 1, 0).wait()


@pytest.mark.parametrize("kinds", [(DELTA, DELTA), (DELTA, FULL), (FULL, DELTA)])
def test_a_leader_rebuilds_the_version_whichever_kind_each_tree_carries(kinds: tuple[int, int]) -> None:
    layout = _layout()
    base, new = _versions(layout)
    streams = DeltaStreams(layout)
    stream = streams.get(version=7, base_version=6, base=base, new=new, base_sums=_sums(layout, base),
                         layout=chunk_layout(layout))  # fmt: skip
    senders, receivers = _pairs(2)
    receiver = HopReceiver(layout)
    hop = TreeHop(receiver)
    receiver.staging.copy_(base)  # no ring: the delta halves are rebuilt in place
    receiver.held = held_of(6, _sums(layout, base))
    receiver.expect(receivers)
    plans = [stream if k == DELTA else None for k in kinds]
    thread = threading.Thread(target=_send, args=(senders, layout, new, plans))
    thread.start()
    msg = hop.receive_both([Interruptible(pg, "gloo") for pg in receivers], [[], []], lambda: True)
    thread.join(30)
    assert torch.equal(receiver.staging, new)
    assert msg.error is None and msg.sums == [s - (1 << 64) if s >= 1 << 63 else s for s in _sums(layout, new)]
    assert msg.delta and msg.version == 7 and msg.seq == 3
    full = layout.total_bytes
    if kinds == (DELTA, DELTA):
        assert msg.stats.wire_bytes < 0.2 * full and 0.02 < msg.stats.changed_share < 0.06, msg.stats
    else:  # one half in full: about half the version, plus the other half's delta
        assert 0.45 * full < msg.stats.wire_bytes < 0.65 * full, msg.stats


def test_a_delta_half_on_a_base_the_leader_does_not_hold_is_refused() -> None:
    layout = _layout()
    base, new = _versions(layout)
    stream = DeltaStreams(layout).get(version=7, base_version=6, base=base, new=new, base_sums=_sums(layout, base),
                                      layout=chunk_layout(layout))  # fmt: skip
    senders, receivers = _pairs(2)
    receiver = HopReceiver(layout)
    hop = TreeHop(receiver)
    receiver.held = Held(5, 1234)
    receiver.expect(receivers)
    thread = threading.Thread(target=_send, args=(senders, layout, new, [stream, None]))
    thread.start()
    msg = hop.receive_both([Interruptible(pg, "gloo") for pg in receivers], [[], []], lambda: True)
    thread.join(30)
    assert msg.sums is None and msg.error is not None
    assert "needs base version 6" in msg.error and "this side holds version 5" in msg.error


def test_chunk_layout_cuts_the_same_bytes_as_the_relay_chunks() -> None:
    layout = _layout()
    cut = chunk_layout(layout)
    assert cut.buckets == tuple((a, b) for a, b, _ in chunks(layout)) and cut.total_bytes == layout.total_bytes
    assert all(a % 8 == 0 and b % 8 == 0 for a, b in cut.buckets)  # whole words, and the codec's 8-byte groups


def test_the_model_counts_the_deltas_wire_size() -> None:
    # In full, as fitted: the chain up to 21 hosts, the trees from 22.
    assert not choose_tree(16, wire_share=1.0, bucket_bytes=32 << 20, current=None)
    assert choose_tree(24, wire_share=1.0, bucket_bytes=32 << 20, current=None)
    # A 3% delta: a tree's unit is one chunk's record, a chain's a 512 KiB piece of a 32 MiB bucket's record.
    chain_s, tree_s = delta_chunks_s(0.03, 32 << 20)
    assert chain_s == pytest.approx(0.006) and tree_s == pytest.approx(0.006 * 0.03)
    chain, tree = pipeline_s(20, chunk_s=chain_s, tree_chunk_s=tree_s)
    assert tree < chain and choose_tree(20, wire_share=0.03, bucket_bytes=32 << 20, current=None)
    assert not choose_tree(20, wire_share=1.0, bucket_bytes=32 << 20, current=None)  # in full: from 22
    assert not choose_tree(19, wire_share=0.03, bucket_bytes=32 << 20, current=None)
    # Small buckets: the chain's records are small too, and it keeps its lead at 8 hosts.
    assert not choose_tree(8, wire_share=0.03, bucket_bytes=1 << 20, current=None)
    # The topology in use is kept unless the other wins by the margin.
    assert choose_tree(21, wire_share=1.0, bucket_bytes=32 << 20, current=True)
    assert not choose_tree(22, wire_share=1.0, bucket_bytes=32 << 20, current=False)


def test_the_policy_reports_the_last_deltas_wire_share() -> None:
    policy = AutoPolicy("auto")
    assert policy.wire_share() == 1.0  # nothing measured yet
    policy.observe(2, DeltaStats(wire_bytes=30, full_bytes=1000))
    assert policy.wire_share() == pytest.approx(0.03)
    policy.observe(3, DeltaStats(wire_bytes=900, full_bytes=1000))  # did not pay: full versions for a while
    assert policy.wire_share() == 1.0
    assert AutoPolicy("off").wire_share() == 1.0
