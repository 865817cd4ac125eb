"""The sharded plane in one process: two trainer ranks' shares (rank 0's sender, rank 1's
ShareWriter), a real TCPStore and a receiver. All shares of a version or none of it."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _sharded import sharded_model, zeroed_sharded_model
from _spawn import CTX
from torch import nn

from lightning_wsync import SenderConfig, WeightReceiver, WeightSender
from lightning_wsync._control.manifest import build_manifest, select_tensors
from lightning_wsync._control.records import RecordShape, ShardsRecord
from lightning_wsync._control.shards import plan_shards
from lightning_wsync._planes.shard import source as shard_source
from lightning_wsync._planes.shard.source import open_rank_rings
from lightning_wsync._planes.shares import ShareWriter
from lightning_wsync._planes.shm.segment import ShmReader
from lightning_wsync._push.shares import prepare_shares
from lightning_wsync.testing.models import digest, mutate

pytestmark = pytest.mark.timeout(120)


_model, _zeroed = sharded_model, zeroed_sharded_model


def test_plan_covers_every_element_once_and_balances_the_bytes():
    model = _model()
    tensors = select_tensors(model)
    layout = build_manifest(tensors, None, 1 << 20)
    plan = plan_shards(tensors, layout, 2, 1 << 20)
    plan.with_segments(["a", "b"]).check(layout)
    shares = plan.share_layouts(layout)
    sizes = [sum(e.nbytes for e in share.entries) for share in shares]
    assert sum(sizes) == sum(e.nbytes for e in layout.entries)
    assert abs(sizes[0] - sizes[1]) < 0.05 * sum(sizes), sizes
    again = type(plan).from_json(plan.to_json())
    assert again == plan


@pytest.mark.parametrize(("dtype", "verify"), [(None, False), ("bfloat16", False), (None, True)])
def test_versions_apply_only_when_every_share_is_complete(server, dtype, verify):
    model = _model()
    cfg = SenderConfig(job="sharded", timeout_s=2, dtype=dtype)
    mine, theirs = prepare_shares(model, cfg, 0, 2), prepare_shares(model, cfg, 1, 2)
    writer = ShareWriter(theirs, cfg)
    plan = mine.plan.with_segments(["", writer.name])
    rollout = _zeroed()
    wire = cfg.wire_dtype
    try:
        shares = dataclasses.replace(mine, plan=plan)
        with WeightSender(model, store=server, config=cfg, shares=shares) as sender, \
                WeightReceiver(rollout, store=server, job="sharded", timeout_s=10, verify=verify) as receiver:
            for version in (1, 2):
                mutate(model, version)
                assert writer.write(version)
                handle = sender.push(version)
                assert receiver.wait_for_version(version, timeout_s=10) == version
                assert digest(rollout, wire) == digest(model, wire)
                report = handle.wait(timeout_s=10)
                assert report.delivered == (receiver.name,) and report.failed == {}, report
            held = digest(rollout)

            mutate(model, 3)  # rank 1 never writes its share of 3: applied nowhere, the report names rank 1
            report = sender.push(3).wait(timeout_s=10)
            assert receiver.update() is None and receiver.version == 2 and digest(rollout) == held
            assert "trainer rank 1 did not complete its share of version 3" in report.failed[receiver.name], report

            mutate(model, 4)  # rank 1 starts its share of 4 and never finishes (as if killed mid-write)
            draft = writer._ring.draft()
            assert draft is not None
            sender.push(4)
            assert receiver.update() is None and receiver.version == 2 and digest(rollout) == held

            mutate(model, 5)  # the next complete version is applied
            assert writer.write(5)
            sender.push(5).wait(timeout_s=10)
            assert receiver.wait_for_version(5, timeout_s=10) == 5
            assert digest(rollout, wire) == digest(model, wire)
    finally:
        writer.close()


def _placement_worker(rank: int, port: int, results: Any) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        tensors = {"ok": distribute_tensor(torch.ones(4, 6), mesh, [Shard(0)]),
                   "wide": distribute_tensor(torch.ones(4, 6), mesh, [Shard(1)])}  # fmt: skip
        layout = build_manifest(tensors, None, 1 << 20)
        try:
            plan_shards(tensors, layout, 2, 1 << 20)
            results.put((rank, None))
        except ValueError as exc:
            results.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


def test_a_placement_other_than_shard_0_is_refused_naming_the_tensor_and_placement(port):
    ctx = CTX
    results = ctx.Queue()
    procs = [ctx.Process(target=_placement_worker, args=(r, port, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        assert got[rank] is not None and "tensor 'wide' has placements (Shard(dim=1),)" in got[rank], got
        assert "exclude=['wide']" in got[rank] and "sharded=False" in got[rank]


def test_the_shard_plan_record_round_trips_and_refuses_a_plan_without_segments():
    model = _model()
    tensors = select_tensors(model)
    layout = build_manifest(tensors, None, 1 << 20)
    plan = plan_shards(tensors, layout, 2, 1 << 20).with_segments(["wsync-1-2-a", "wsync-1-3-a"])
    assert ShardsRecord.decode(ShardsRecord(plan).encode()).plan == plan
    with pytest.raises(RecordShape, match="0 segment names and 0 hosts for 2 shares"):
        ShardsRecord.decode(dataclasses.replace(plan, segments=()).to_json())


_Pair = tuple[nn.Module, nn.Module, ShareWriter, WeightSender, WeightReceiver]


@contextlib.contextmanager
def _live_pair(server: Any, cfg: SenderConfig) -> Iterator[_Pair]:
    """Rank 0's sender (and its model) and rank 1's share writer of ``cfg.job``, and one receiver (and its module)
    live at version 1."""
    model, rollout = _model(), _zeroed()
    mine, theirs = prepare_shares(model, cfg, 0, 2), prepare_shares(model, cfg, 1, 2)
    writer = ShareWriter(theirs, cfg)
    shares = dataclasses.replace(mine, plan=mine.plan.with_segments(["", writer.name]))
    try:
        with WeightSender(model, store=server, config=cfg, shares=shares) as sender, \
                WeightReceiver(rollout, store=server, job=cfg.job, timeout_s=10) as receiver:
            mutate(model, 1)
            assert writer.write(1)
            sender.push(1)
            assert receiver.wait_for_version(1, timeout_s=10) == 1  # live from here on
            yield model, rollout, writer, sender, receiver
    finally:
        writer.close()


def test_a_rank_that_never_writes_is_named_while_the_sender_keeps_its_pace(server):
    """Rank 0 waits for rank 1's missing shares on a thread of its own, not the sender's background
    thread: the report of a version rank 1 never wrote, awaited as the callback does (the sender's
    timeout_s, from the push, with heartbeat_timeout_s far below it), names rank 1 rather than a silent
    receiver; and while a version is awaited the next complete one is published and applied at once."""
    cfg = SenderConfig(job="lapse", timeout_s=4, heartbeat_timeout_s=1)
    with _live_pair(server, cfg) as (model, rollout, writer, sender, receiver):
        mutate(model, 2)  # rank 1 never writes its share of 2; nothing newer comes
        report = sender.push(2).wait()
        assert report.delivered == () and list(report.failed) == [receiver.name], report
        assert report.failed[receiver.name].startswith(
            "trainer rank 1 did not complete its share of version 2 within timeout_s=4"), report
        assert receiver.version == 1 and sender.receivers() == [receiver.name]

        mutate(model, 3)  # nor of 3; but it writes 4 while rank 0 still waits for its share of 3
        pushed = time.monotonic()
        third = sender.push(3)
        mutate(model, 4)
        assert writer.write(4)
        sender.push(4)
        assert receiver.wait_for_version(4, timeout_s=10) == 4
        assert time.monotonic() - pushed < cfg.timeout_s / 2, "version 4 was held behind the wait for 3"
        assert digest(rollout) == digest(model)
        assert third.wait().delivered == (receiver.name,)  # it holds 4


def test_a_report_names_only_its_own_versions_missing_share(server):
    """The plane's verdicts are per version: the report of a complete version whose receiver has not applied
    it does not name a newer version's missing share, nor the report of a version still being written an older
    version's; each says its own receiver did not acknowledge it. (Before, the plane kept only its newest
    verdict, and every pending report named it.)"""
    cfg = SenderConfig(job="verdicts", timeout_s=2)
    with _live_pair(server, cfg) as (model, rollout, writer, sender, receiver):
        mutate(model, 2)  # complete, but the receiver does not apply it (no update()) ...
        at_two = digest(model)
        assert writer.write(2)
        second = sender.push(2)
        mutate(model, 3)  # ... while rank 1 never writes its share of 3
        third = sender.push(3)
        report = third.wait()
        assert report.failed[receiver.name].startswith(
            "trainer rank 1 did not complete its share of version 3"), report
        report = second.wait(timeout_s=cfg.timeout_s * 2)  # well past 3's verdict
        assert report.delivered == (), report
        assert report.failed[receiver.name].startswith("no acknowledgement of version 2 within"), report
        assert receiver.update() == 2 and digest(rollout) == at_two  # 2 was whole all along

        mutate(model, 4)  # rank 1 writes its share of 4 only after the report gave up: 3's verdict is not 4's
        fourth = sender.push(4)
        report = fourth.wait(timeout_s=cfg.timeout_s / 4)
        assert report.failed[receiver.name].startswith("no acknowledgement of version 4 within"), report
        assert writer.write(4)
        assert receiver.wait_for_version(4, timeout_s=10) == 4
        assert digest(rollout) == digest(model)


def test_a_fleet_switches_together_to_versions_every_rank_wrote(server):
    """Fleet receivers of a sharded sender stage each round's target itself from every rank's ring
    (not the newest), verifying or not; at every switch both hold that version, bit-exact."""
    model = _model()
    cfg = SenderConfig(job="shfleet", timeout_s=10)
    mine, theirs = prepare_shares(model, cfg, 0, 2), prepare_shares(model, cfg, 1, 2)
    writer = ShareWriter(theirs, cfg)
    shares = dataclasses.replace(mine, plan=mine.plan.with_segments(["", writer.name]))
    mods = {n: _zeroed() for n in "ab"}
    digests: dict[int, str] = {}
    try:
        with WeightSender(model, store=server, config=cfg, shares=shares) as sender, \
                WeightReceiver(mods["a"], store=server, job="shfleet", name="a", fleet="g", verify=True) as a, \
                WeightReceiver(mods["b"], store=server, job="shfleet", name="b", fleet="g") as b:
            deadline = time.monotonic() + 60
            for version in range(1, 10**6):
                mutate(model, version)
                digests[version] = digest(model)
                writer.write(version)
                sender.push(version)
                a.update(), b.update()
                switches = sender.fleet_switches("g")
                if len({s.version for s in switches if {a.rid, b.rid} <= set(s.rids)}) >= 4:
                    break
                assert time.monotonic() < deadline, f"the fleet did not move: {switches}"
                time.sleep(0.02)  # the trainer's pace, not a synchronisation
            while True:  # pushes have stopped: the fleet settles on one last switch
                a.update(), b.update()
                final = sender.fleet_switches("g")[-1]
                if a.version == b.version == final.version and {a.rid, b.rid} <= set(final.rids):
                    break
                assert time.monotonic() < deadline, (a.version, b.version, final)
                time.sleep(0.01)
            assert digest(mods["a"]) == digest(mods["b"]) == digests[final.version]
            assert a.rejected == b.rejected == 0
    finally:
        writer.close()


def test_a_fleet_round_holds_its_target_in_every_ranks_ring_while_pushes_go_on(server):
    """A round's target stays in rank 1's ring too (not rank 0's alone): a member that stages it only after
    both ranks pushed three newer versions (its staging held off) still stages it, and the fleet switches to
    it with that member, bit-exact. Without the hold in rank 1's ring, rank 1's two slots would hold the two
    newest versions by then and the member would be left out of the round."""
    model = _model()
    cfg = SenderConfig(job="shfleethold", timeout_s=20)
    mine, theirs = prepare_shares(model, cfg, 0, 2), prepare_shares(model, cfg, 1, 2)
    writer = ShareWriter(theirs, cfg)
    shares = dataclasses.replace(mine, plan=mine.plan.with_segments(["", writer.name]))
    rollout = _zeroed()
    digests: dict[int, str] = {}

    def push(version: int) -> None:
        mutate(model, version)
        digests[version] = digest(model)
        assert writer.write(version), version  # never dropped: the held slot is one of two
        assert not sender.push(version).dropped, version

    def until(what: str, done: Any) -> None:
        deadline = time.monotonic() + 30
        while not done():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    try:
        with WeightSender(model, store=server, config=cfg, shares=shares) as sender, \
                WeightReceiver(rollout, store=server, job="shfleethold", name="a", fleet="g") as a:
            push(1)
            until("the fleet's first switch", lambda: (a.update(), a.version)[1] == 1)
            with a._apply_lock:  # the member cannot stage (a slow copy) while this is held
                push(2)
                group = sender._fleet._groups["g"]
                until("the round of version 2", lambda: group.open is not None and group.open.version == 2)
                for version in (3, 4, 5):  # both rings move on around the held slot
                    push(version)
            until("the switch to version 2", lambda: any(
                s.version == 2 and a.rid in s.rids for s in sender.fleet_switches("g")))  # fmt: skip
            until("a switched version applied", lambda: (a.update(), a.version)[1] in (2, 5))
            assert digest(rollout) == digests[a.version]  # 2, or already the next round's target (5)
    finally:
        writer.close()


def test_a_receiver_waiting_for_a_version_is_woken_by_whichever_rank_completes_it_last(monkeypatch):
    """Every rank's own ring wakes its readers, so a receiver on the trainer's host waits on all of them at
    once instead of reading every ring's header every few ms: with the header poll pushed past the test's
    bound, rank 1's share landing after rank 0's still ends the wait, and the version is then complete."""
    monkeypatch.setattr(shard_source, "_WOKEN_POLL_S", 60.0)
    model, rollout = _model(), _zeroed()
    cfg = SenderConfig(job="woken", timeout_s=2)
    writers = [ShareWriter(prepare_shares(model, cfg, rank, 2), cfg) for rank in (0, 1)]
    shares = prepare_shares(model, cfg, 0, 2)
    plan = shares.plan.with_segments([w.name for w in writers])
    tensors = select_tensors(rollout, cfg.include, cfg.exclude)
    source = open_rank_rings(1, shares.layout, plan, [tensors[e.name] for e in shares.layout.entries], "r")
    waiting = threading.Event()
    real = ShmReader.wait_any

    def wait_any(readers: list[ShmReader], timeout_s: float) -> None:
        waiting.set()
        real(readers, timeout_s)

    monkeypatch.setattr(ShmReader, "wait_any", staticmethod(wait_any))
    try:
        mutate(model, 1)
        assert writers[0].write(1)
        elapsed: list[float] = []

        def wait() -> None:
            started = time.monotonic()
            source.wait_change(started + 30, lambda: False)
            elapsed.append(time.monotonic() - started)

        waiter = threading.Thread(target=wait, name="test-waiter", daemon=True)
        waiter.start()
        assert waiting.wait(10)
        assert writers[1].write(1)
        waiter.join(timeout=20)
        assert elapsed and elapsed[0] < 10, elapsed
        assert source.newest_complete() == 1
        assert source.apply(None, None, lambda v, why: None) == 1
        assert digest(rollout) == digest(model)
    finally:
        source.close()
        for w in writers:
            w.close()
