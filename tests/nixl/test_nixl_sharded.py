"""Sharded streams over NIXL: a trainer of two ranks (rank 0 a ``WeightSender`` with its share, rank 1 a
``ShareWriter`` on another host id, as the callback drives them; both in this process, as
tests/relay/test_relay_sharded.py does) with ``transport='nixl'``. Each rank lends its share's ring over
NIXL and each stream's leaders READ it hop by hop, down a chain or one tree, to receivers on simulated
hosts of their own (child processes). Receivers apply whole versions only, bit-exact (issue 30)."""

from __future__ import annotations

import dataclasses
import gc
import os
import queue
import signal
import time
from typing import Any

import pytest
from _nixl_workers import sharded_receiver_main
from _spawn import CTX
from _workers import Inbox, build, collect, digest, mutate

from lightning_wsync import SenderConfig, WeightSender
from lightning_wsync._control import keys
from lightning_wsync._control.records import ChainRecord, NixlAgentRecord
from lightning_wsync._planes.nixl.agent import Agent, unusable
from lightning_wsync._planes.shares import ShareWriter
from lightning_wsync._push.shares import prepare_shares
from lightning_wsync.errors import WeightSyncConfigError

pytestmark = pytest.mark.timeout(300)
needs_nixl = pytest.mark.skipif(unusable() is not None, reason=f"{unusable()}")
NAMES = ("h0", "h1", "h2")


class Trainer:
    """Ranks 0 (host trainer-a, the sender) and 1 (host trainer-b, its share's writer), and receivers on
    hosts of their own; every report kept per receiver."""

    def __init__(self, children: Any, port: int, monkeypatch: pytest.MonkeyPatch, spec: tuple[str, int],
                 receiver: dict[str, Any], **config: Any) -> None:  # fmt: skip
        monkeypatch.setenv("WSYNC_HOST_ID", "trainer-a")
        self.store, self.spec = f"127.0.0.1:{port}", spec
        self.model = build(spec)
        self.cfg = SenderConfig(job="nxs", transport="nixl", **config)
        mine = prepare_shares(self.model, self.cfg, 0, 2)
        self.theirs = dataclasses.replace(prepare_shares(self.model, self.cfg, 1, 2), host="trainer-b")
        self.writer = ShareWriter(self.theirs, self.cfg)
        plan = mine.plan.with_segments(["", self.writer.name], ["trainer-a", "trainer-b"])
        try:
            self.sender = WeightSender(self.model, store=self.store, config=self.cfg,
                                       shares=dataclasses.replace(mine, plan=plan))  # fmt: skip
        except BaseException:
            self.writer.close()
            raise
        self._shut = False
        try:
            self._start(children, spec, receiver)
        except BaseException:
            self.shut()
            raise

    def _start(self, children: Any, spec: tuple[str, int], receiver: dict[str, Any]) -> None:
        self.writer.relay(self.store, self.sender.epoch, self.cfg)
        self.streams = [keys.relay_stream(self.sender.epoch, rank) for rank in (0, 1)]
        self.results = Inbox(CTX)
        self.pushed: dict[int, str] = {}
        self.seen: dict[str, list[tuple[int, str]]] = {n: [] for n in NAMES}
        self.planes: set[str] = set()
        self.reading: list[tuple[Any, ...]] = []  # ("hop-reading", name, version, rank, rid, upstream)
        self.closed: dict[str, tuple[Any, ...]] = {}
        self.pids: dict[str, int] = {}
        for name in NAMES:
            p = CTX.Process(target=sharded_receiver_main, daemon=True,
                            args=(self.store, "nxs", name, spec, self.results.queue(name), dict(receiver)))  # fmt: skip
            p.start()
            children.track(p.pid)
            self.pids[name] = p.pid
        collect(self.results, "ready", set(NAMES), timeout_s=120)

    def chains(self, timeout_s: float, hosts: int = len(NAMES)) -> list[ChainRecord]:
        """Both streams' chains (or trees), once each names ``hosts`` leaders."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = [self.sender._ctl.get_record(keys.relay_chain(s), ChainRecord) for s in self.streams]
            if all(c is not None and len(c.rids) == hosts for c in got):
                return [c for c in got if c is not None]
            assert time.monotonic() < deadline, f"the streams' chains never named {hosts} leaders: {got}"
            self.drain(0.05)

    def push(self, version: int, *, rank1: bool = True) -> None:
        mutate(self.model, version)
        self.pushed[version] = digest(self.model)
        if rank1:
            assert self.writer.write(version)
        self.sender.push(version)

    def drain(self, timeout_s: float) -> None:
        for name in NAMES:
            try:
                msg = self.results.queues[name].get(timeout=timeout_s / len(NAMES))
            except queue.Empty:
                continue
            assert msg[0] != "error", msg
            if msg[0] == "version":
                self.seen[name].append((msg[2], msg[3]))
                self.planes.add(msg[5])
            elif msg[0] == "hop-reading":
                self.reading.append(msg)
            elif msg[0] == "left":
                self.closed[name] = msg

    def until(self, names: tuple[str, ...], version: int, timeout_s: float) -> None:
        """Wait until each of ``names`` applied ``version`` or newer; every version applied anywhere is one
        pushed, bit-exact (never a torn one, nor a mix of two versions' shares)."""
        deadline = time.monotonic() + timeout_s
        while any(not self.seen[n] or self.seen[n][-1][0] < version for n in names):
            if time.monotonic() >= deadline:
                self.stacks(names)
            assert time.monotonic() < deadline, f"not all of {names} reached version {version}: {self.seen}"
            self.drain(0.03)
        for n, seen in self.seen.items():
            assert all(d == self.pushed[v] for v, d in seen), f"{n} applied a version unlike the one pushed: {seen}"

    def stacks(self, names: tuple[str, ...]) -> None:
        """Have each of ``names`` print every thread's stack to its stderr (kept in the test's report)."""
        for name in names:
            try:
                os.kill(self.pids[name], signal.SIGUSR1)
            except ProcessLookupError:
                continue
        time.sleep(2.0)  # not a sync: the stacks are a diagnosis of a failure already decided

    def shut(self) -> None:
        """Close rank 0's sender, then rank 1's writer (once)."""
        if not self._shut:
            self._shut = True
            try:
                self.sender.close()
            finally:
                self.writer.close()

    def close(self, names: tuple[str, ...]) -> None:
        """Close both ranks; every receiver in ``names`` says it closed with no wsync thread and no NIXL agent
        left, and this process holds no NIXL agent either (its threads: the no_leaks fixture)."""
        self.shut()
        deadline = time.monotonic() + 60
        while set(self.closed) < set(names):
            assert time.monotonic() < deadline, f"receivers did not close: {sorted(set(names) - set(self.closed))}"
            self.drain(0.05)
        for name in names:
            assert self.closed[name][2:] == ([], []), self.closed[name]  # threads, agents
        gc.collect()
        assert [a.name for a in gc.get_objects() if type(a) is Agent and a._nixl is not None] == []


def _upstreams(chain: ChainRecord) -> set[tuple[int, int | None]]:
    """(leader, the leader it READs from) down a chain, or one tree (each leader's parent in the binary heap)."""
    r = chain.rids
    return {(rid, None if i == 0 else r[(i - 1) // 2 if chain.tree else i - 1]) for i, rid in enumerate(r)}


@pytest.mark.slow
@needs_nixl
@pytest.mark.parametrize("cross_host", ["chain", "tree"])
def test_each_rank_relays_its_share_over_nixl_hops_and_every_host_is_bit_exact(children, server, port, monkeypatch,
                                                                                cross_host):  # fmt: skip
    run = Trainer(children, port, monkeypatch, ("big", 16), {"timeout_s": 20}, cross_host=cross_host, timeout_s=20)
    try:
        chains = run.chains(120)
        for stream, chain in zip(run.streams, chains):
            assert chain.tree == (cross_host == "tree"), (stream, chain)
            record = run.sender._ctl.get_record(keys.nixl_agent(stream, "sender"), NixlAgentRecord)
            assert record is not None, f"stream {stream}: its rank's ring is not lent over NIXL"
        for version in (1, 2, 3):
            run.push(version)
            run.until(NAMES, version, 60)
            assert {n: run.seen[n][-1] for n in NAMES} == {n: (version, run.pushed[version]) for n in NAMES}
        assert run.planes == {"relay across hosts, sharded over 2 trainer ranks (2 streams relayed)"}
        assert [run.sender._ctl.get_record(keys.relay_chain(s), ChainRecord) for s in run.streams] == chains
        by_rid: dict[int, str] = {}
        for msg in run.reading:
            by_rid.setdefault(msg[4], msg[1])
        for rank, chain in enumerate(chains):  # every stream's hops, as its chain or tree says
            got = {(m[4], m[5]) for m in run.reading if m[3] == rank and m[2] == 3}
            assert got == _upstreams(chain), (rank, got, chain)
        run.close(NAMES)
    finally:
        run.shut()


TIMEOUT_S, HEARTBEAT_TIMEOUT_S = 6.0, 2.0


@pytest.mark.slow
@needs_nixl
@pytest.mark.parametrize("cross_host", ["chain", "tree"])
def test_a_leader_killed_mid_read_of_one_stream_leaves_no_torn_version_or_mix_and_the_rest_catch_up(
    children, server, port, monkeypatch, cross_host
):
    """Rank 1's stream is slowed at version 2 (about 1 s a hop), rank 0's is not: the last leader's upstream
    (the middle of a chain, the root of a tree) is SIGKILLed while the last leader READs rank 1's share of
    version 2 from it (it has rank 0's share of 2 in full). No receiver applies a version unlike the one
    pushed (so never rank 0's share of 2 with rank 1's of 1); the others apply version 3 bit-exact; they
    close with no thread or NIXL agent left."""
    receiver = {"timeout_s": TIMEOUT_S, "slow_rank": 1, "slow_versions": [2], "delay_s": 0.25}
    run = Trainer(children, port, monkeypatch, ("big", 32), receiver, cross_host=cross_host, timeout_s=TIMEOUT_S,
                  heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)  # fmt: skip
    try:
        chains = run.chains(120)
        run.push(1)
        run.until(NAMES, 1, 60)
        run.push(2)
        chain = run.sender._ctl.get_record(keys.relay_chain(run.streams[1]), ChainRecord)
        assert chain is not None and len(chain.rids) == 3 and chain == chains[1]
        assert chain.tree == (cross_host == "tree"), chain
        last = chain.rids[2]
        victim = dict(_upstreams(chain))[last]  # the middle of the chain; the root of the tree
        assert victim is not None
        deadline = time.monotonic() + 60
        while not any(m[2:] == (2, 1, last, victim) for m in run.reading):  # the last READs rank 1's share of 2
            assert time.monotonic() < deadline, f"the last leader never READ rank 1's share of version 2: {run.reading}"
            run.drain(0.03)
        names = {m[4]: m[1] for m in run.reading}
        os.kill(run.pids[names[victim]], signal.SIGKILL)
        killed = time.monotonic()
        survivors = tuple(names[r] for r in chain.rids if r != victim)
        run.push(3)
        run.until(survivors, 3, 60)
        caught_up = time.monotonic() - killed
        print(f"\n{cross_host}: the survivors applied version 3 {caught_up:.2f} s after the leader was killed "
              f"(timeout_s={TIMEOUT_S}, heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S})")  # fmt: skip
        assert caught_up < TIMEOUT_S + HEARTBEAT_TIMEOUT_S, caught_up
        assert {n: run.seen[n][-1] for n in survivors} == {n: (3, run.pushed[3]) for n in survivors}
        for n in survivors:  # version 2 whole or not at all: never a mix of the ranks' shares
            assert [v for v, _ in run.seen[n]] in ([1, 2, 3], [1, 3]), run.seen
        alive = {r for r in chain.rids if r != victim}
        for rank in (0, 1):  # both streams re-formed without the dead host's leader
            now = run.sender._ctl.get_record(keys.relay_chain(run.streams[rank]), ChainRecord)
            assert now is not None and victim not in now.rids and set(now.rids) == alive, (rank, now)
        run.close(survivors)
    finally:
        run.shut()


def test_a_sharded_push_over_nixl_with_cross_host_star_is_refused_naming_the_fix(server, port, monkeypatch):
    """No silent fallback: the star has no relay stream per rank (needs no NIXL: refused before it is asked)."""
    monkeypatch.setenv("WSYNC_HOST_ID", "trainer-a")
    model = build(("big", 4))
    cfg = SenderConfig(job="nxs-star", transport="nixl", cross_host="star", timeout_s=5)
    mine = prepare_shares(model, cfg, 0, 2)
    plan = mine.plan.with_segments(["", "wsync-none"], ["trainer-a", "trainer-b"])
    with pytest.raises(WeightSyncConfigError, match=(
        r"transport='nixl' with cross_host='star' asks for one NIXL READ of the whole version per receiver; "
        r"use cross_host='chain' or 'tree' .*, or push unsharded \(sharded=False\)")):  # fmt: skip
        WeightSender(model, store=f"127.0.0.1:{port}", config=cfg, shares=dataclasses.replace(mine, plan=plan))
