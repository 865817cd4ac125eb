"""A slow copy is not a stall (issue 21 item 9): a same-host reader renews its pin as it
copies, and a network link renews its lease as each piece goes out, so a copy or a send
that takes longer than the lease but keeps making progress still holds its slot."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _spawn import CTX

from lightning_wsync._control.manifest import build_manifest
from lightning_wsync._control.store import Control
from lightning_wsync._planes.delta.encode import AutoPolicy
from lightning_wsync._planes.net import sendlink as net_link
from lightning_wsync._planes.shm import segment as shm_segment
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync._planes.shm.segment import ShmReader, ShmSegment, unlink_segment

_ENTRIES = 8
_LEASE_S = 0.3
_PER_TENSOR_S = 0.15  # the reader's copy takes _ENTRIES x this = 1.2 s, four leases


def _layout():
    return build_manifest({f"t{i}": torch.zeros(1024) for i in range(_ENTRIES)}, None, 1 << 20)


def _pusher(name: str, ready: mp.Event, stop: mp.Event) -> None:
    """A trainer pushing a new version every 20 ms (dropped while every slot is held)."""
    layout = _layout()
    segment = ShmSegment(name, layout.total_bytes, create=True, slots=2)
    ring = SnapshotRing(layout, segment=segment, device=torch.device("cpu"), slots=2, lease_s=_LEASE_S)
    version = 1
    ring.write(version, [torch.full((1024,), float(version))] * _ENTRIES)
    ready.set()
    while not stop.wait(0.02):
        version += 1
        ring.write(version, [torch.full((1024,), float(version))] * _ENTRIES)
    ring.close()
    segment.close()


@pytest.mark.timeout(120)
def test_a_same_host_copy_slower_than_the_lease_completes_intact(children, monkeypatch, request):
    """Failed before: the pin was stamped once, so the pusher overwrote the slot 0.3 s into
    the 1.2 s copy and unpin() reported it torn."""
    real_copy = shm_segment.copy_tensors

    def slow_copy(dst, src):  # a slow destination (pageable memory into a GPU): time per tensor
        time.sleep(_PER_TENSOR_S * len(dst))
        real_copy(dst, src)

    monkeypatch.setattr(shm_segment, "copy_tensors", slow_copy)
    monkeypatch.setattr(shm_segment, "_TOUCH_BYTES", 4096, raising=False)  # renew after every tensor
    name = f"wsync-{os.getpid()}-0-slow{abs(hash(request.node.name)) % 10**6}"
    layout = _layout()
    ctx = CTX
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_pusher, args=(name, ready, stop))
    proc.start()
    children.track(proc.pid)
    reader = None
    try:
        assert ready.wait(60)
        reader = ShmReader(name, layout)
        # Each copy must end intact; the case needs pushes going on meanwhile (into the other slot),
        # which a pusher starved of CPU can miss in one 1.2 s copy (seen at load 15): copies are
        # repeated, five at most, until one saw a push.
        overlapped = []
        while not any(overlapped) and len(overlapped) < 5:
            ref = reader.newest()
            assert ref is not None and reader.pin(ref)
            out = [torch.zeros(1024) for _ in range(_ENTRIES)]
            started = time.monotonic()
            reader.copy_to(ref, out)
            took = time.monotonic() - started
            newest = reader.newest()
            assert reader.unpin(ref), "the slot was overwritten under a copy that kept making progress"
            assert took > 3 * _LEASE_S
            assert all(torch.equal(t, torch.full((1024,), float(ref.version))) for t in out)
            overlapped.append(newest is not None and newest.version > ref.version)
        assert any(overlapped), f"the pusher pushed nothing during {len(overlapped)} copies"
    finally:
        stop.set()
        proc.join(30)
        if reader is not None:
            reader.close()
        unlink_segment(f"/dev/shm/{name}")


class _SlowWork:
    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def wait(self) -> bool:
        time.sleep(self._seconds)
        return True


class _SlowLink:
    """A peer group whose sends complete at 8 MiB/s, one after another (a slow link)."""

    def __init__(self) -> None:
        self.trailer: list[int] | None = None

    def send(self, tensors, dst_rank, tag):
        (t,) = tensors
        self.trailer = t.tolist() if t.dtype == torch.int64 else self.trailer
        return _SlowWork(t.numel() * t.element_size() / (8 << 20))


def test_a_network_send_slower_than_the_lease_keeps_its_slot():
    """Failed before: the lease was renewed only after each 4 MiB bucket (0.5 s at 8 MiB/s,
    past the 0.25 s lease), so pushes meanwhile overwrote the slot and the trailer said so."""
    layout = build_manifest({"w": torch.zeros(1 << 20)}, None, 32 << 20)  # one 4 MiB bucket
    assert len(layout.buckets) == 1
    ring = SnapshotRing(layout, segment=None, device=torch.device("cpu"), slots=2, lease_s=0.25)
    ctl = Control(dist.HashStore(), "j", None)
    send = object.__new__(net_link.NetSendLink)  # its send path only, on a fake slow group
    send.rid, send.superseded, send.delta_versions, send.sent_version = 0, 0, {}, None
    send._ring, send._policy, send._epoch = ring, AutoPolicy("off"), 1
    ring.write(1, [torch.full((1 << 20,), 1.0)])
    lease = ring.acquire_newer(None, 1.0)
    assert lease is not None
    stop = threading.Event()

    def push() -> None:
        version = 2
        while not stop.wait(0.02):
            ring.write(version, [torch.full((1 << 20,), float(version))])
            version += 1

    pusher = threading.Thread(target=push, name="test-pusher")
    pusher.start()
    pg = _SlowLink()
    try:
        send._send_version(pg, ctl, "ann", lease, None)
    finally:
        stop.set()
        pusher.join(10)
        lease.release()
    assert pg.trailer is not None and pg.trailer[0] == lease.ref.seq, "the send was superseded"
    assert send.superseded == 0 and send.sent_version == 1 and ring.newest().version > 2
