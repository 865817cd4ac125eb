"""``zero_copy`` (on by default, ``"auto"``): engine workers on the trainer's host load each version
straight out of the host's shared memory, without a private copy each (no vLLM needed: the workers
are :class:`WsyncWorkerExtension` objects with real receivers, a real store and a real ring).

What is checked: every tensor handed to ``reload_weights`` lies in a read-only mapping of
the snapshot segment; the workers' anonymous memory does not grow by a copy of the weights
(it does by one per worker without ``zero_copy``); a slot overwritten while a worker loads
it fails the load with ``WeightSyncIntegrityError`` and the next ``update()`` loads the
newest everywhere. The default is on where the worker maps the trainer's ring, off (copying) with
``fleet`` or where versions come over the network, and each worker says which, once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection

import pytest
import torch
from _workers import big_model, digest, mixed_model, mutate
from test_tp_commit import FakeEngine, FakeWorker
from torch import nn

from lightning_wsync import WeightSender, WeightSyncIntegrityError
from lightning_wsync.engines.vllm import VllmWeightSync
from lightning_wsync.testing.procs import Children, init_child, receive, report_failure

pytestmark = pytest.mark.timeout(120)


class LendingWorker(FakeWorker):
    """Loads into its model without keeping a copy; notes where each tensor it was handed lives."""

    def __init__(self, rank: int, model: nn.Module) -> None:
        super().__init__(rank)
        self.model = model
        self.ptrs: list[list[int]] = []
        self.before_read: Callable[[], None] | None = None

    def reload_weights(self, *, weights_iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        hook, self.before_read = self.before_read, None
        if hook is not None:
            hook()
        weights = dict(weights_iterator)
        self.ptrs.append([t.data_ptr() for t in weights.values()])
        self.model.load_state_dict(weights)  # copies into the model's own tensors


def segment_mappings(readonly: bool = True) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of wsync snapshot segments (the readers' are read-only)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "/wsync-" in fields[5] and fields[1].startswith("r--" if readonly else "r"):
                a, b = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((a, b))
    return ranges


def anon_bytes() -> int:
    """This process's resident anonymous memory (private copies; shared memory is not counted)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@contextmanager
def lending_engine(
    port: int, job: str, model: Callable[[], nn.Module], zero_copy: bool | None = None, verify: bool = False,
    transport: str = "auto",
) -> Iterator[tuple[nn.Module, FakeEngine, WeightSender, VllmWeightSync]]:
    """``zero_copy=None``: the default (not passed)."""
    src, engine = model(), FakeEngine(2)
    engine.workers = [LendingWorker(rank, model()) for rank in range(2)]
    store = f"127.0.0.1:{port}"
    chosen = {} if zero_copy is None else {"zero_copy": zero_copy}
    with (
        WeightSender(src, store=store, job=job, timeout_s=10, transport=transport) as sender,
        VllmWeightSync(engine, store=store, job=job, name="engine", timeout_s=10, verify=verify, **chosen) as sync,
    ):
        yield src, engine, sender, sync


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_workers_load_views_of_the_shared_segment(port, verify):
    with lending_engine(port, f"zc-v{verify}", lambda: mixed_model(1), verify=verify) as (src, engine, sender, sync):
        for version in range(4):
            mutate(src, version)
            sender.push(version)
            assert sync.wait_for_version(version) == version
            assert [digest(w.model) for w in engine.workers] == [digest(src)] * 2
        ranges = segment_mappings()
        assert ranges, "no read-only mapping of a snapshot segment"
        for w in engine.workers:
            assert len(w.ptrs) == 4
            outside = [p for load in w.ptrs for p in load if not any(a <= p < b for a, b in ranges)]
            assert not outside, f"worker {w.rank} was handed tensors outside the shared segment: {outside}"
        assert [(s["version"], s["zero_copy"]) for s in sync.state()] == [(3, True), (3, True)]
        assert sync.update() is None  # nothing newer: no load, no pin held
        assert [w._wsync_lender.loan for w in engine.workers] == [None, None]  # type: ignore[union-attr]


def measure_growth(conn: Connection, port: int, zero_copy: bool | None, mb: int) -> None:
    """In a fresh process (no freed memory to reuse): private memory grown by two versions' loads."""
    init_child()
    try:
        with lending_engine(port, "zc-rss", lambda: big_model(mb), zero_copy) as (src, engine, sender, sync):
            sender.push(0)
            before = anon_bytes()
            assert sync.wait_for_version(0) == 0
            mutate(src, 1)
            sender.push(1)
            assert sync.update() == 1
            grown = anon_bytes() - before
            assert [digest(w.model) for w in engine.workers] == [digest(src)] * 2
        conn.send(("grown", grown))
    except Exception:  # noqa: BLE001 - the parent shows it
        report_failure(conn, "measure_growth")


@pytest.mark.parametrize("zero_copy", [None, False], ids=["default", "copying"])
def test_no_private_copy_of_the_weights(port, zero_copy):
    mb = 64
    with Children() as kids:
        grown = receive(kids.start(measure_growth, (port, zero_copy, mb), "measure"), 90, "the growth")[1]
    assert isinstance(grown, int)
    if zero_copy is None:  # the default lends
        assert grown < (mb << 20) // 4, f"the workers' private memory grew by {grown / 2**20:.1f} MiB"
    else:  # the measurement sees private copies: one per worker
        assert grown > 1.5 * (mb << 20), f"copying workers grew by only {grown / 2**20:.1f} MiB"


def test_a_slot_overwritten_during_the_load_fails_it_and_the_next_update_loads_the_newest(port):
    with lending_engine(port, "zc-torn", lambda: mixed_model(1)) as (src, engine, sender, sync):
        sender.push(0)
        assert sync.wait_for_version(0) == 0
        mutate(src, 1)
        sender.push(1)
        w1 = engine.workers[1]

        def stall_past_the_lease() -> None:
            # as if worker 1 stopped past the sender's lease: its pin lapses, two pushes
            # later the slot it loads from holds version 3
            source = w1._wsync_lender._held[0]  # type: ignore[union-attr,index]
            source._reader._pin.release()
            for version in (2, 3):
                mutate(src, version)
                assert not sender.push(version).dropped, f"version {version} dropped"

        w1.before_read = stall_past_the_lease
        with pytest.raises(WeightSyncIntegrityError, match=r"loading version 1 failed .*overwritten in shared memory"):
            sync.update()
        assert sync.version is None
        assert [s["version"] for s in sync.state()] == [1, None]
        assert sync.update() == 3  # the newest, everywhere
        assert [digest(w.model) for w in engine.workers] == [digest(src)] * 2
        assert [s["version"] for s in sync.state()] == [3, 3]


def test_a_push_landing_while_a_loan_and_another_reader_hold_both_slots_is_dropped_and_said_once(port, caplog):
    """The cost of a loan: the sender has one slot left; while another reader holds that one too, pushes are
    dropped (counted; the first drop is a warning naming the loan as a cause), and the engine catches up after."""
    caplog.set_level("WARNING", logger="lightning_wsync._push.sender")
    with lending_engine(port, "zc-drop", lambda: mixed_model(1)) as (src, engine, sender, sync):
        sender.push(0)
        assert sync.wait_for_version(0) == 0
        mutate(src, 1)
        sender.push(1)
        dropped: list[bool] = []
        at_two: list[str] = []

        def hold_the_other_slot() -> None:  # worker 1 holds its loan of version 1 meanwhile
            mutate(src, 2)
            at_two.append(digest(src))
            assert not sender.push(2).dropped  # into the one slot the loan leaves
            ring = sender._ring
            ref = ring.find(2)
            lease = None if ref is None else ring.acquire(ref)  # another reader on this host holds 2 (a fleet round)
            assert lease is not None
            try:
                for version in (3, 4):
                    mutate(src, version)
                    dropped.append(sender.push(version).dropped)
            finally:
                lease.release()

        engine.workers[1].before_read = hold_the_other_slot
        assert sync.update() == 1
        assert dropped == [True, True] and sender.dropped_pushes == 2
        said = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("version 3 dropped: every snapshot slot is being read"), said
        assert "an engine worker's zero_copy loan" in said[0] and "(said for the first drop only)" in said[0]
        assert sync.update() == 2 and [digest(w.model) for w in engine.workers] == at_two * 2


def test_zero_copy_is_refused_with_fleet_and_the_default_is_off_with_it_saying_why(port, caplog):
    store = f"127.0.0.1:{port}"
    with pytest.raises(ValueError, match=r"VllmWeightSync: zero_copy=True with fleet='g'"):
        VllmWeightSync(FakeEngine(1), store=store, job="zc", zero_copy=True, fleet="g")
    with pytest.raises(TypeError, match=r"VllmWeightSync: zero_copy='yes' must be True, False or 'auto'"):
        VllmWeightSync(FakeEngine(1), store=store, job="zc", zero_copy="yes")  # type: ignore[arg-type]
    caplog.set_level("INFO", logger="lightning_wsync.engines._worker.commit")
    with (
        WeightSender(mixed_model(1), store=store, job="zc", timeout_s=10),  # hosts the store
        VllmWeightSync(FakeEngine(1), store=store, job="zc", fleet="g") as sync,
    ):
        assert [s["zero_copy"] for s in sync.state()] == [False]
    said = [r.getMessage() for r in caplog.records if "zero_copy" in r.getMessage()]
    assert said == ["VllmWeightSync: zero_copy off: with fleet='g' each worker stages its round's version in a "
                    "private copy"], said  # fmt: skip


@pytest.mark.parametrize("transport", ["auto", "gloo"], ids=["trainer-ring", "network"])
def test_the_default_lends_where_the_ring_is_mapped_and_copies_elsewhere_saying_which_once(port, caplog, transport):
    """The default: a worker mapping the trainer's ring loads views of it; one whose versions come over the
    network (the sender's transport='gloo' here, as on another host or with a ring it cannot map) copies; each
    worker says which once, not at every version."""
    caplog.set_level("INFO", logger="lightning_wsync.engines._worker.commit")
    lends = transport == "auto"
    with lending_engine(port, f"zc-{transport}", lambda: mixed_model(1), transport=transport) as (
        src, engine, sender, sync,
    ):  # fmt: skip
        for version in range(3):
            mutate(src, version)
            sender.push(version)
            assert sync.wait_for_version(version) == version
            assert [digest(w.model) for w in engine.workers] == [digest(src)] * 2
        assert [s["zero_copy"] for s in sync.state()] == [lends, lends]
        ranges = segment_mappings()
        inside = [any(a <= p < b for a, b in ranges) for w in engine.workers for load in w.ptrs for p in load]
        assert inside and all(x == lends for x in inside), inside
    said = [r.getMessage() for r in caplog.records if "zero_copy='auto' is" in r.getMessage()]
    word = "is on: versions load straight out of the trainer host's shared memory" if lends else "is off here"
    assert sorted(m.split("'")[1] for m in said) == ["engine-w0", "engine-w1"], said  # once per worker
    assert all(word in m for m in said), said


def test_a_sharded_senders_rings_are_lent_to_both_workers_stitching_only_a_cut_tensor(port):
    """A sharded push (rank 0's sender, rank 1's ring): both workers of a TP=2 engine load every version
    bit-exact out of both ranks' rings at once. Each tensor one rank's share holds whole is handed as a view
    of that rank's read-only mapping; only the tensor the plan cuts across the ranks (the 2 MiB weight) is
    stitched into a buffer of the worker's (one per worker, reused)."""
    import dataclasses
    import math

    from _sharded import sharded_model, zeroed_sharded_model

    from lightning_wsync import SenderConfig
    from lightning_wsync._planes.shares import ShareWriter
    from lightning_wsync._push.shares import prepare_shares
    from lightning_wsync.testing.models import digest as full_digest
    from lightning_wsync.testing.models import mutate as step

    model = sharded_model()
    cfg = SenderConfig(job="zc-sharded", timeout_s=10)
    mine, theirs = prepare_shares(model, cfg, 0, 2), prepare_shares(model, cfg, 1, 2)
    numel = [math.prod(e.shape) for e in mine.layout.entries]
    cut = {p.entry for share in mine.plan.shares for p in share if p.end - p.start != numel[p.entry]}
    names = [e.name for e in mine.layout.entries]
    assert [names[i] for i in cut] == ["0.weight"], cut
    writer = ShareWriter(theirs, cfg)
    shares = dataclasses.replace(mine, plan=mine.plan.with_segments(["", writer.name]))
    engine = FakeEngine(2)
    engine.workers = [LendingWorker(rank, zeroed_sharded_model()) for rank in range(2)]
    store = f"127.0.0.1:{port}"
    try:
        with (
            WeightSender(model, store=store, config=cfg, shares=shares) as sender,
            VllmWeightSync(engine, store=store, job="zc-sharded", name="engine", timeout_s=10) as sync,  # lends
        ):
            for version in range(1, 4):
                step(model, version)
                assert writer.write(version)
                sender.push(version)
                assert sync.wait_for_version(version) == version
                assert [full_digest(w.model) for w in engine.workers] == [full_digest(model)] * 2, version
            ranges = segment_mappings()
            for w in engine.workers:
                assert len(w.ptrs) == 3
                for load in w.ptrs:
                    outside = [i for i, p in enumerate(load) if not any(a <= p < b for a, b in ranges)]
                    assert [names[i] for i in outside] == ["0.weight"], (w.rank, outside)
                assert len({load[names.index("0.weight")] for load in w.ptrs}) == 1  # one buffer, reused
            assert [(s["version"], s["zero_copy"]) for s in sync.state()] == [(3, True), (3, True)]
    finally:
        writer.close()
