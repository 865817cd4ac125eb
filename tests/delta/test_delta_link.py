"""Deltas over a real two-rank gloo group: this process sends, a spawned process receives."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import _delta_workers
import pytest
import torch
import torch.distributed as dist
from _delta_workers import sums, versions
from _spawn import CTX
from conftest import Children

from lightning_wsync._control.manifest import Manifest, entry_views
from lightning_wsync._planes.delta.codec import base_digest, sampled_changed_share
from lightning_wsync._planes.delta.encode import (
    AUTO_MAX_WIRE_SHARE,
    AutoPolicy,
    DeltaStream,
    DeltaStreams,
    EncoderPool,
    delta_base,
)
from lightning_wsync._planes.delta.wire import DeltaStats, Held, parse_ready_note, ready_note, send_records
from lightning_wsync._planes.shm.ring import Lease, SnapshotRing
from lightning_wsync._planes.wire import PeerGroup, make_group
from lightning_wsync.config import CallbackConfig, SenderConfig

pytestmark = pytest.mark.timeout(90)


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


def _run(port: int, children: Children, helds: list[str], stream: DeltaStream, layout: Manifest) -> list[Any]:
    """Send ``stream`` once per entry of ``helds`` to a receiver process; return what it reported."""
    here, there = CTX.Pipe()
    p = CTX.Process(target=_delta_workers.receiver, args=(port, helds, there), daemon=True)
    p.start()
    children.track(p.pid or 0)
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    pg: PeerGroup = make_group("gloo", dist.PrefixStore("t/", store), 0, "127.0.0.1", 30)
    got = []
    for _ in helds:
        send_records(pg, stream, len(layout.buckets), torch.device("cpu"))
        assert here.poll(30), "the receiver process reported nothing within 30 s"
        got.append(here.recv())
    pg.send([torch.tensor([42], dtype=torch.int64)], 1, 0).wait()
    assert here.poll(30)
    got.append(here.recv())
    p.join(10)
    return got


def _stream(layout: Manifest, base: torch.Tensor, new: torch.Tensor, workers: int = 2) -> DeltaStream:
    return DeltaStream(EncoderPool(layout, workers), version=2, base_version=1, base=base, new=new,
                       base_sums=sums(layout, base))  # fmt: skip


@pytest.mark.slow
def test_delta_over_gloo_rebuilds_bit_exact_in_place(port: int, children: Children) -> None:
    layout, base, new = versions()
    stream = _stream(layout, base, new)
    got, marker = _run(port, children, ["base"], stream, layout)
    assert got["error"] is None and got["is_new"]
    assert got["sums"] == [_signed(s) for s in sums(layout, new)]
    sent = stream.stats()
    assert got["wire_bytes"] == sent.wire_bytes + 8 * len(layout.buckets)  # plus one size word per bucket
    assert sent.wire_bytes < 0.2 * layout.total_bytes
    assert got["changed_share"] == pytest.approx(500 / (layout.total_bytes // 2), rel=0.01)
    assert marker == 42


@pytest.mark.slow
def test_wrong_base_is_refused_and_the_link_stays_in_step(port: int, children: Children) -> None:
    layout, base, new = versions()
    *got, marker = _run(port, children, ["old", "digest", "none", "base"], _stream(layout, base, new), layout)
    for refused in got[:3]:
        assert refused["sums"] is None and "needs base version 1" in refused["error"]
        assert refused["is_base"]  # refused before any byte was written
    assert got[3]["error"] is None and got[3]["is_new"]  # the same link, in step, takes the next delta
    assert marker == 42


@pytest.mark.slow
def test_corrupted_record_fails_the_checksums(port: int, children: Children) -> None:
    layout, base, new = versions()
    stream = _stream(layout, base, new)
    record = stream.record(1)
    payload = bytearray(record.payload)
    payload[-3] ^= 0x40
    stream._records[1] = record._replace(payload=bytes(payload))
    got, _ = _run(port, children, ["base"], stream, layout)
    expected = [_signed(s) for s in sums(layout, new)]
    if got["sums"] is None:
        assert got["error"]  # a record check caught it
    else:
        assert got["sums"][1] != expected[1] and got["sums"][0] == expected[0]  # the checksum catches it
    assert not got["is_new"]


@pytest.mark.parametrize("workers", [1, 3])
def test_one_encoding_serves_every_link(workers: int) -> None:
    layout, base, new = versions()
    pool = EncoderPool(layout, workers)
    calls: list[int] = []
    encode = pool.encode

    def counting(index: int, *args: Any) -> Any:
        calls.append(index)
        return encode(index, *args)

    pool.encode = counting  # type: ignore[method-assign]
    stream = DeltaStream(pool, version=2, base_version=1, base=base, new=new, base_sums=sums(layout, base))
    got: dict[int, list[Any]] = {}
    def read_all(n: int) -> None:
        got[n] = [stream.record(i) for i in range(len(layout.buckets))]

    readers = [threading.Thread(target=read_all, args=(n,), name=f"test-reader-{n}") for n in range(3)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(30)
    stream.join(10)
    assert sorted(calls) == list(range(len(layout.buckets)))  # each bucket encoded once
    assert got[0] == got[1] == got[2] and [r.bucket for r in got[0]] == list(range(len(layout.buckets)))
    assert stream.stats().changed_share == pytest.approx(500 / (layout.total_bytes // 2), rel=0.01)
    assert stream.stats().encode_s > 0


def test_ready_note_round_trips_and_an_old_receiver_holds_nothing() -> None:
    held = Held(7, 2**64 - 5)
    assert parse_ready_note(ready_note(held, 0.25)) == (held, 0.25)
    assert parse_ready_note(ready_note(None, None)) == (None, None)
    assert parse_ready_note("1") == (None, None)
    assert parse_ready_note(None) == (None, None)


def test_streams_are_shared_per_base_and_version_and_old_ones_dropped() -> None:
    layout, base, new = versions()
    streams = DeltaStreams(layout, keep=2)
    s = sums(layout, base)
    a = streams.get(version=2, base_version=1, base=base, new=new, base_sums=s)
    assert streams.get(version=2, base_version=1, base=base, new=new, base_sums=s) is a
    assert streams.get(version=2, base_version=0, base=base, new=new, base_sums=s) is not a
    for i in range(len(layout.buckets)):
        a.record(i)
    got = streams.stats_for(2)
    assert got is not None and got.wire_bytes == a.stats().wire_bytes
    streams.get(version=3, base_version=2, base=new, new=base, base_sums=s)
    streams.get(version=4, base_version=3, base=base, new=new, base_sums=s)
    assert streams.stats_for(2) is None and streams.stats_for(4) is not None


def test_auto_backs_off_after_a_delta_that_did_not_pay() -> None:
    with pytest.raises(ValueError, match=r"WeightSender: delta='sometimes' must be one of \['auto', 'off', 'always'\]"):
        SenderConfig(delta="sometimes")
    with pytest.raises(ValueError, match=r"WeightSyncCallback: delta='never' must be one of"):
        CallbackConfig(every_n_steps=1, delta="never")
    assert CallbackConfig(every_n_steps=1, delta="off").sender_config().delta == "off"
    assert SenderConfig().delta == "auto"
    assert not AutoPolicy("off").want_delta(1)
    always = AutoPolicy("always")
    always.observe(1, DeltaStats(wire_bytes=100, full_bytes=100))
    assert always.want_delta(2)
    auto = AutoPolicy("auto")
    assert auto.want_delta(1) and auto.want_delta(1)  # once per version, the same for every link
    auto.observe(1, DeltaStats(wire_bytes=int(AUTO_MAX_WIRE_SHARE * 100), full_bytes=100))
    assert auto.want_delta(2)
    auto.observe(2, DeltaStats(wire_bytes=90, full_bytes=100))
    auto.observe(2, DeltaStats(wire_bytes=90, full_bytes=100))  # a second link's report of the same version
    assert [auto.want_delta(v) for v in range(3, 12) for _ in range(2)] == [False] * 16 + [True] * 2


def test_ring_finds_a_complete_version_by_number() -> None:
    from lightning_wsync._control.manifest import build_manifest
    from lightning_wsync._planes.shm.ring import SnapshotRing

    layout = build_manifest({"w": torch.zeros(100)}, None, 1 << 20)
    ring = SnapshotRing(layout, segment=None, device=torch.device("cpu"), slots=2, lease_s=5.0)
    assert ring.find(1) is None
    first = ring.write(1, [torch.zeros(100)])
    second = ring.write(2, [torch.ones(100)])
    assert first is not None and second is not None
    assert ring.find(1) == first and ring.find(2) == second
    assert torch.equal(ring.buffers[first.slot].view(torch.float32)[:100], torch.zeros(100))
    ring.write(3, [torch.full((100,), 3.0)])  # into the oldest slot: version 1 is gone
    assert ring.find(1) is None and ring.find(2) == second and ring.find(3) is not None
    ring.close()


def _ring_with(layout: Manifest, *buffers: torch.Tensor) -> tuple[SnapshotRing, list[Lease]]:
    ring = SnapshotRing(layout, segment=None, device=torch.device("cpu"), slots=len(buffers), lease_s=30)
    leases = []
    for version, buffer in enumerate(buffers, start=1):
        ring.write(version, entry_views(layout, buffer))
        lease = ring.acquire_newer(version - 1, 0)
        assert lease is not None
        leases.append(lease)
    return ring, leases


def test_auto_sends_in_full_without_encoding_when_most_words_changed() -> None:
    layout, base, new = versions(n_changed=500)
    assert sampled_changed_share(base, base.clone(), 2) == 0.0
    everywhere = base.clone()
    everywhere.view(torch.int16).add_(1)  # fp32 weights after an optimizer step change almost everywhere
    assert sampled_changed_share(base, everywhere, 2) == 1.0
    deltas = DeltaStreams(layout)
    for changed, policy, want in ((new, "auto", True), (everywhere, "auto", False), (everywhere, "always", True)):
        ring, (old, current) = _ring_with(layout, base, changed)
        held = Held(1, base_digest(sums(layout, old.buffer)))
        got = delta_base(ring, deltas, AutoPolicy(policy), held, current, "peer")
        assert (got is not None) is want, (policy, want)
        if got is not None:
            got[1].release()
        old.release()
        current.release()
    deltas.close()
