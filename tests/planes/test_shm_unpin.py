"""A reader's unpin is bounded when a writer marked its slot and never completed the write
(issue 21 item 1): a trainer SIGKILLed right after ``begin_write``, or a relay leader that
discarded a draft written into the slot after the reader's pin expired. Both used to spin
in ``_settled_seq`` forever (holding the receiver's apply lock)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch
from _spawn import CTX

from lightning_wsync._control.manifest import build_manifest
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync._planes.shm.segment import ShmReader, ShmSegment, SlotRef, unlink_segment


def _layout():
    return build_manifest({"x": torch.zeros(1024)}, None, 1 << 20)


def _writer(name: str, to_test: mp.Queue, from_test: mp.Queue, kill: bool) -> None:
    """Publish versions 1 and 2, then (once the test has pinned version 1) leave its slot marked."""
    layout = _layout()
    segment = ShmSegment(name, layout.total_bytes, create=True, slots=2)
    ring = SnapshotRing(layout, segment=segment, device=torch.device("cpu"), slots=2, lease_s=0.2)
    v1 = ring.write(1, [torch.full((1024,), 1.0)])
    v2 = ring.write(2, [torch.full((1024,), 2.0)])
    assert v1 is not None and v2 is not None
    to_test.put((tuple(v1), tuple(v2)))
    from_test.get(timeout=60)  # the test holds a pin on version 1
    if kill:
        segment.begin_write(v1.slot)  # the trainer's claim of the slot, then SIGKILL
        os.kill(os.getpid(), signal.SIGKILL)
    held = ring.acquire(v2)  # a link holds version 2: the next draft must take version 1's slot
    assert held is not None
    deadline = time.monotonic() + 30
    while (draft := ring.draft()) is None:  # until the test's pin on version 1 is past its lease
        assert time.monotonic() < deadline, "the reader's pin never expired"
        time.sleep(0.01)
    assert draft.slot == v1.slot
    draft.buffer.view(torch.float32)[:1024] = 9.0  # received into the slot, then failed its checks
    draft.discard()
    to_test.put("discarded")
    from_test.get(timeout=60)  # stays alive (a live leader) until the test is done
    held.release()
    ring.close()
    segment.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kill", [True, False], ids=["writer-killed-after-begin-write", "draft-discarded"])
def test_unpin_returns_within_its_bound_when_a_marked_slot_is_never_completed(kill, children, request):
    name = f"wsync-{os.getpid()}-0-unpin{abs(hash(request.node.name)) % 10**6}"
    layout = _layout()
    ctx = CTX
    to_test, from_test = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_writer, args=(name, to_test, from_test, kill))
    proc.start()
    children.track(proc.pid)
    reader = None
    try:
        v1, v2 = (SlotRef(*ref) for ref in to_test.get(timeout=60))
        reader = ShmReader(name, layout)
        assert reader.pin(v1)
        from_test.put("pinned")
        if kill:
            proc.join(30)
            assert proc.exitcode == -signal.SIGKILL
        else:
            assert to_test.get(timeout=60) == "discarded"
        assert reader.change_marker()[v1.slot] == v1.seq + 1  # marked, and left so
        result: list[bool] = []
        unpin = threading.Thread(target=lambda: result.append(reader.unpin(v1)), daemon=True)
        started = time.monotonic()
        unpin.start()
        unpin.join(10)
        assert result == [False], "unpin() did not return within 10 s"  # not intact: copy the newest again
        assert time.monotonic() - started < 5
        assert reader.newest() == v2  # the complete version is still there to copy
        out = [torch.zeros(1024)]
        assert reader.pin(v2)
        reader.copy_to(v2, out)
        assert reader.unpin(v2) and torch.equal(out[0], torch.full((1024,), 2.0))
    finally:
        if not kill:
            from_test.put("done")
            proc.join(30)
        if reader is not None:
            reader.close()
        unlink_segment(f"/dev/shm/{name}")
