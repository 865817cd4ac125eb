"""The snapshot ring in one process and across processes: pins keep a version intact while read."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch
from _spawn import CTX

from lightning_wsync._control.manifest import build_manifest
from lightning_wsync._planes.shm.files import check_segment_name
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync._planes.shm.segment import ShmReader, ShmSegment, SlotRef, remove_stale_segments
from lightning_wsync.errors import WeightSyncConfigError


def _layout():
    return build_manifest({"x": torch.zeros(1024)}, None, 1 << 20)


@pytest.fixture
def ring(request):
    layout = _layout()
    name = f"wsync-{os.getpid()}-0-{abs(hash(request.node.name)) % 10**8}"
    segment = ShmSegment(name, layout.total_bytes, create=True, slots=2)
    ring = SnapshotRing(layout, segment=segment, device=torch.device("cpu"), slots=2, lease_s=5.0)
    yield ring, layout, name
    ring.close()
    segment.close()


def _fill(value: float) -> list[torch.Tensor]:
    return [torch.full((1024,), value)]


def test_header_shows_only_completed_writes_and_the_newest_wins(ring):
    ring_, layout, name = ring
    reader = ShmReader(name, layout)
    try:
        assert reader.newest() is None  # nothing written yet
        first = ring_.write(7, _fill(7.0))
        assert first is not None and reader.newest() == first
        second = ring_.write(8, _fill(8.0))
        assert second is not None and second.slot != first.slot and reader.newest() == second
        out = [torch.zeros(1024)]
        assert reader.pin(second)
        reader.copy_to(second, out)
        assert reader.unpin(second) and torch.equal(out[0], _fill(8.0)[0])
    finally:
        reader.close()


def test_a_pinned_slot_is_never_overwritten_and_a_full_ring_drops_the_push(ring):
    ring_, layout, name = ring
    readers = [ShmReader(name, layout), ShmReader(name, layout)]
    try:
        v1 = ring_.write(1, _fill(1.0))
        assert v1 is not None and readers[0].pin(v1)  # a reader is copying version 1
        v2 = ring_.write(2, _fill(2.0))
        assert v2 is not None and v2.slot != v1.slot  # went to the other slot
        assert readers[1].pin(v2)  # and a second reader copies version 2
        assert ring_.write(3, _fill(3.0)) is None  # every slot held: dropped, nothing overwritten
        assert ring_.dropped == 1
        out = [torch.zeros(1024)]
        readers[0].copy_to(v1, out)
        assert readers[0].unpin(v1) and torch.equal(out[0], _fill(1.0)[0])
        v4 = ring_.write(4, _fill(4.0))
        assert v4 is not None and v4.slot == v1.slot  # the slot version 1 was read from, now free
        assert readers[1].unpin(v2)  # version 2 stayed intact under its pin
        assert not readers[0].pin(v1)  # a stale reference cannot be pinned
    finally:
        for r in readers:
            r.close()


def test_final_push_waits_for_a_slot_within_its_bound(ring):
    ring_, layout, name = ring
    reader = ShmReader(name, layout)
    try:
        v1 = ring_.write(1, _fill(1.0))
        v2 = ring_.write(2, _fill(2.0))
        assert v1 is not None and v2 is not None
        assert reader.pin(v1)
        lease = ring_.acquire(v2)  # a network link sending version 2
        assert lease is not None
        started = time.monotonic()
        assert ring_.write(3, _fill(3.0), wait_s=0.05) is None
        assert 0.05 <= time.monotonic() - started < 2
        lease.release()
        v3 = ring_.write(3, _fill(3.0), wait_s=1.0)
        assert v3 is not None and v3.slot == v2.slot
        assert reader.unpin(v1)
    finally:
        reader.close()


def test_a_stalled_readers_pin_expires_after_the_lease_and_it_sees_the_overwrite(ring):
    ring_, layout, name = ring
    ring_.lease_s = 0.05
    reader = ShmReader(name, layout)
    try:
        v1 = ring_.write(1, _fill(1.0))
        v2 = ring_.write(2, _fill(2.0))
        assert v1 is not None and v2 is not None and reader.pin(v1)
        lease = ring_.acquire(v2)
        assert lease is not None
        deadline = time.monotonic() + 5
        while (v3 := ring_.write(3, _fill(3.0))) is None:  # both leases age past 50 ms
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert v3.slot in (v1.slot, v2.slot)
        stale_reader_intact = reader.unpin(v1)
        assert stale_reader_intact == (v3.slot != v1.slot) and (lease.intact() == (v3.slot != v2.slot))
        lease.release()
    finally:
        reader.close()


def _pin_and_die(name: str, total: int, ref: tuple[int, int, int]) -> None:
    layout = build_manifest({"x": torch.zeros(total // 4)}, None, 1 << 20)
    reader = ShmReader(name, layout)
    assert reader.pin(SlotRef(*ref))
    os._exit(0)  # killed mid-copy: its pin file stays behind


def test_a_dead_readers_pin_is_ignored(ring):
    ring_, layout, name = ring
    v1 = ring_.write(1, _fill(1.0))
    v2 = ring_.write(2, _fill(2.0))
    assert v1 is not None and v2 is not None
    ctx = CTX
    for ref in (v1, v2):
        proc = ctx.Process(target=_pin_and_die, args=(name, layout.total_bytes, tuple(ref)))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
    assert len([n for n in os.listdir(ring_.segment.pin_dir) if n.startswith("pin-")]) == 2
    assert ring_.write(3, _fill(3.0)) is not None  # both pins belong to a dead process
    assert ring_.dropped == 0


def test_segment_names_from_the_store_are_checked():
    assert check_segment_name("wsync-12-3-job_a") == "wsync-12-3-job_a"
    for bad in ("../etc/passwd", "wsync-1-2-a/b", "x", "wsync-1-2-" + "a" * 65):
        with pytest.raises(WeightSyncConfigError, match="is not one lightning_wsync creates"):
            check_segment_name(bad)


def test_segments_of_a_dead_creator_are_reclaimed():
    ctx = CTX
    proc = ctx.Process(target=_create_named_after_self)
    proc.start()
    proc.join(60)
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"wsync-{proc.pid}-")]
    assert leftovers, "the child did not leave its segment behind"
    remove_stale_segments()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"wsync-{proc.pid}-")]


def _create_named_after_self() -> None:
    ShmSegment(f"wsync-{os.getpid()}-0-reclaim", 4096, create=True, slots=2)
    os._exit(0)



def _close_under_readers(name: str, rounds: int) -> None:
    """Close a reader while another thread reads its header, ``rounds`` times (a SIGSEGV fails the test)."""
    layout = _layout()
    for _ in range(rounds):
        reader = ShmReader(name, layout)
        polling, stop = threading.Event(), threading.Event()

        def poll(reader: ShmReader = reader, polling: threading.Event = polling, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                try:
                    reader.change_marker()
                    reader.newest()
                except (AttributeError, ValueError):
                    pass
                polling.set()

        thread = threading.Thread(target=poll)
        thread.start()
        polling.wait(10)
        reader.close()
        stop.set()
        thread.join()


def test_closing_a_reader_under_a_concurrent_header_read_never_crashes(ring):
    """A host ring re-followed (new leader) closes its reader while the watcher polls the header."""
    ring_, layout, name = ring
    ring_.write(1, _fill(1.0))
    proc = CTX.Process(target=_close_under_readers, args=(name, 300))
    proc.start()
    proc.join(timeout=120)
    if proc.is_alive():
        proc.kill()
        pytest.fail("reader close loop ran past 120 s")
    assert proc.exitcode == 0, f"reader process died with exit code {proc.exitcode} (negative: signal)"


def test_a_draft_is_never_readable_until_committed_and_a_discarded_one_never(ring):
    """A relay leader receives a version straight into a slot (a draft): readers see the
    slot only once it is committed; a discarded draft (a version that failed its checks)
    stays unreadable, the version before it stays the newest, and the slot is claimed again."""
    ring_, layout, name = ring
    reader = ShmReader(name, layout)
    try:
        v1 = ring_.write(1, _fill(1.0))
        draft = ring_.draft()
        assert draft is not None and draft.slot != v1.slot
        draft.buffer[: layout.total_bytes].view(torch.float32)[:1024] = 2.0  # written in place
        assert reader.newest() == v1  # half-written: not visible
        draft.discard()
        assert reader.newest() == v1 and ring_.seq(draft.slot) % 2 == 1
        again = ring_.draft()  # the discarded slot is taken again and stays marked while written
        assert again is not None and again.slot == draft.slot and ring_.seq(again.slot) % 2 == 1
        again.buffer[: layout.total_bytes].view(torch.float32)[:1024] = 3.0
        v3 = again.commit(3)
        assert reader.newest() == v3 and v3.seq % 2 == 0
        out = [torch.zeros(1024)]
        assert reader.pin(v3)
        reader.copy_to(v3, out)
        assert reader.unpin(v3) and torch.equal(out[0], _fill(3.0)[0])
        # An older version committed after a newer one (a resend) does not become the newest.
        older = ring_.draft()
        assert older is not None and older.slot == v1.slot
        older.commit(2)
        assert reader.newest() == v3 and ring_.newest() == v3
    finally:
        reader.close()


def test_the_writer_wakes_waiting_readers_and_clears_dead_ones(ring):
    """Readers wait on a wake-up socket instead of polling the header: a version landing
    ends a 30 s wait at once; a dead reader's socket file is removed by the next write."""
    ring_, layout, name = ring
    reader = ShmReader(name, layout)
    try:
        assert reader.woken
        stale = os.path.join(ring_.segment.pin_dir, "wake-999999-0")
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        dead.bind(stale)
        dead.close()  # bound, then gone without unlinking: what a SIGKILLed reader leaves
        woke = threading.Event()

        def waiter() -> None:
            reader.wait(30.0)
            woke.set()

        thread = threading.Thread(target=waiter, name="test-wake-waiter")
        thread.start()
        ring_.write(1, _fill(1.0))
        assert woke.wait(10.0), "the write did not wake the waiting reader"
        thread.join(5)
        assert not os.path.exists(stale)
    finally:
        reader.close()


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "private"])
def test_acquire_newer_never_leases_a_slot_being_rewritten(shared, request):
    """Both slot storages behave alike; the published slot claimed by a draft (every other
    slot held) is not leased until a version is committed again (it failed before: the
    lease came back on a slot whose bytes were being rewritten)."""
    layout = _layout()
    name = f"wsync-{os.getpid()}-0-{abs(hash(request.node.name)) % 10**8}"
    segment = ShmSegment(name, layout.total_bytes, create=True, slots=2) if shared else None
    ring_ = SnapshotRing(layout, segment=segment, device=torch.device("cpu"), slots=2, lease_s=5.0)
    try:
        v1, v2 = ring_.write(1, _fill(1.0)), ring_.write(2, _fill(2.0))
        assert v1 is not None and v2 is not None and ring_.newest() == v2
        held = ring_.acquire(v1)  # a link sending version 1 holds the other slot
        assert held is not None
        draft = ring_.draft()
        assert draft is not None and draft.slot == v2.slot and ring_.seq(v2.slot) % 2 == 1
        assert ring_.acquire_newer(None, 0.05) is None
        assert ring_.acquire_newer(1, 0.05) is None
        draft.buffer.view(torch.float32)[:1024] = 3.0
        v3 = draft.commit(3)
        lease = ring_.acquire_newer(2, 1.0)
        assert lease is not None and lease.ref == v3 and lease.intact()
        assert torch.equal(lease.buffer.view(torch.float32)[:1024], _fill(3.0)[0])
        lease.release()
        held.release()
    finally:
        ring_.close()
        if segment is not None:
            segment.close()
