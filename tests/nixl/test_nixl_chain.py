"""Relay hops over NIXL through real processes: host leaders of a chain READ each version from
the upstream ring (the trainer's, then the previous leader's, lent while it is still written)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import secrets
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _nixl_hop_workers import leader_main

from lightning_wsync._control import keys
from lightning_wsync._control.manifest import build_manifest, entry_views
from lightning_wsync._control.store import Control
from lightning_wsync._planes.nixl.agent import unusable
from lightning_wsync._planes.nixl.lend import owner_key
from lightning_wsync._planes.nixl.send import NixlSendPlane
from lightning_wsync._planes.relay.hops import read_chain
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync._planes.shm.segment import ShmSegment, segment_name

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(unusable() is not None, reason=f"{unusable()}")]  # fmt: skip
CTX = mp.get_context("spawn")
STREAM, JOB, SECRET = 3, "hop", b"hop-secret"


class Trainer:
    """The trainer's ring (in shared memory) lent over NIXL, as a sender with transport='nixl' does."""

    def __init__(self, ctl: Control, mib: int = 12) -> None:
        n = mib << 18  # fp32 words
        self.tensors = {"a": torch.zeros(n // 2), "b": torch.zeros(n // 3), "c": torch.zeros(n - n // 2 - n // 3)}
        self.layout = build_manifest(self.tensors, None, bucket_bytes=3 << 20)
        name = segment_name(f"hoptest-t-{secrets.token_hex(4)}", STREAM)
        self.segment = ShmSegment(name, self.layout.total_bytes, create=True, slots=2)
        self.ring = SnapshotRing(self.layout, segment=self.segment, device=torch.device("cpu"), slots=2, lease_s=5.0)
        self.plane = NixlSendPlane(ctl, self.ring, self.segment, epoch=STREAM, name=f"wsync-s{STREAM}-{os.getpid()}-t")

    def push(self, version: int) -> str:
        g = torch.Generator().manual_seed(version)
        for t in self.tensors.values():
            t.copy_(torch.randn(t.shape, generator=g))
        ref = self.ring.write(version, list(self.tensors.values()), wait_s=5.0)
        assert ref is not None
        flat = torch.empty(self.layout.total_bytes, dtype=torch.uint8)
        for view, t in zip(entry_views(self.layout, flat), self.tensors.values()):
            view.copy_(t)
        return hashlib.sha256(flat.numpy().tobytes()).hexdigest()

    def close(self) -> None:
        assert self.plane.close(time.monotonic() + 5) == []
        self.ring.close()
        self.segment.close()


class Chain:
    def __init__(self, children: Any, port: int) -> None:
        self.server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=30))  # fmt: skip
        self.ctl = Control(self.server, JOB, SECRET)
        self.trainer = Trainer(self.ctl)
        self.children = children
        self.port = port
        self.queues: dict[int, Any] = {}
        self.procs: dict[int, Any] = {}

    def start(self, rid: int, upstream: int | None, **options: Any) -> None:
        self.queues[rid] = CTX.Queue()
        p = CTX.Process(target=leader_main, daemon=True, args=(
            f"127.0.0.1:{self.port}", JOB, SECRET, STREAM, rid, upstream, self.trainer.layout.to_json(),
            self.queues[rid], options))  # fmt: skip
        p.start()
        self.children.track(p.pid)
        self.procs[rid] = p

    def expect(self, rid: int, kind: str, timeout_s: float, version: int | None = None) -> tuple[Any, ...]:
        """The next report of ``kind`` from leader ``rid`` (for ``version`` when given); fails on a rejection."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                msg = self.queues[rid].get(timeout=0.05)
            except queue.Empty:
                continue
            assert msg[0] != "rejected", msg
            if msg[0] == kind and (version is None or msg[2] == version):
                return tuple(msg)
        raise AssertionError(f"leader {rid}: no {kind!r} (version {version}) within {timeout_s} s")

    def stop(self) -> dict[int, list[str]]:
        alive = [rid for rid, p in self.procs.items() if p.is_alive()]  # before "stop": each then closes and exits
        self.ctl.set_text("stop", "1")
        left = {rid: list(self.expect(rid, "closed", 30)[2]) for rid in alive}
        for p in self.procs.values():
            p.join(timeout=30)
        self.trainer.close()
        return left


def test_three_leaders_chained_over_nixl_get_every_version_bit_exact(children, port):
    chain = Chain(children, port)
    rids = [1, 2, 3]
    for rid, up in zip(rids, [None, 1, 2]):
        chain.start(rid, up)
    for rid in rids:
        chain.expect(rid, "ready", 120)
    for version in range(1, 5):
        want = chain.trainer.push(version)
        got = {rid: chain.expect(rid, "version", 60, version)[3] for rid in rids}
        assert got == {rid: want for rid in rids}
    assert chain.stop() == {1: [], 2: [], 3: []}  # no thread of the hop left behind
    assert all(p.exitcode == 0 for p in chain.procs.values())



def test_a_leader_reads_the_version_its_upstream_is_still_writing(children, port):
    """Pipelined: leader 3 is lent leader 2's draft slot while leader 2 still READs it (slowly),
    chunk by chunk as it lands there, and gets every version bit-exact."""
    chain = Chain(children, port)
    chain.start(1, None)
    chain.start(2, 1, chunk_delay_s=0.1)  # >= 1.2 s per version: 12 chunks of 1 MiB
    chain.start(3, 2)
    for rid in (1, 2, 3):
        chain.expect(rid, "ready", 120)
    for version in range(1, 4):
        want = chain.trainer.push(version)
        got = {rid: chain.expect(rid, "version", 60, version)[3:] for rid in (1, 2, 3)}
        assert {rid: g[0] for rid, g in got.items()} == {1: want, 2: want, 3: want}
        assert got[1][1] is False and got[3][1] is True  # the trainer lends published slots only
    assert chain.stop() == {1: [], 2: [], 3: []}


def test_a_leader_killed_mid_read_stalls_nobody_upstream_and_a_new_one_catches_up(children, port):
    chain = Chain(children, port)
    chain.start(1, None)
    chain.start(2, 1)
    chain.start(3, 2, chunk_delay_s=0.3, slow_from=2)  # ~4 s per version from version 2 on
    for rid in (1, 2, 3):
        chain.expect(rid, "ready", 120)
    want = chain.trainer.push(1)
    assert {rid: chain.expect(rid, "version", 60, 1)[3] for rid in (1, 2, 3)} == {1: want, 2: want, 3: want}
    chain.trainer.push(2)
    chain.expect(3, "reading", 60, 2)
    os.kill(chain.procs[3].pid, signal.SIGKILL)  # mid-READ of version 2 from leader 2's ring
    chain.procs[3].join(timeout=10)
    for version in (3, 4):
        start = time.monotonic()
        want = chain.trainer.push(version)
        assert {rid: chain.expect(rid, "version", 30, version)[3] for rid in (1, 2)} == {1: want, 2: want}
        assert time.monotonic() - start < 10, "the upstream waited on its killed reader"
    chain.start(4, 2)  # the killed leader's successor, READing from the same upstream
    assert chain.expect(4, "version", 120, 4)[3] == want
    assert chain.stop() == {1: [], 2: [], 4: []}


def test_a_sender_with_transport_nixl_relays_down_a_chain_of_three_hosts_bit_exact(children, port):
    """The public surface: WeightSender(transport='nixl'), receivers on three simulated hosts,
    each its host's leader: the chain's hops are NIXL READs (the head sends nothing)."""
    from _nixl_workers import remote_receiver_main
    from _workers import Inbox, build, collect, digest, mutate

    from lightning_wsync import WeightSender

    spec = ("mixed", 0)
    model = build(spec)
    results = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    names = {"h0", "h1", "h2"}
    with WeightSender(model, store=store, job="nxc", transport="nixl", cross_host="chain", timeout_s=20) as sender:
        procs = []
        for name in sorted(names):
            p = CTX.Process(target=remote_receiver_main, daemon=True,
                            args=(store, "nxc", name, spec, results.queue(name), {}))  # fmt: skip
            p.start()
            children.track(p.pid)
            procs.append(p)
        collect(results, "ready", names, timeout_s=120)
        for version in range(1, 5):
            mutate(model, version)
            want = digest(model)
            sender.push(version).wait(timeout_s=60)
            got = collect(results, "version", names, timeout_s=60)
            assert {n: (m[2], m[3]) for n, m in got.items()} == {n: (version, want) for n in names}
        ctl = Control(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)), "nxc")
        chain = read_chain(ctl, sender.epoch)
        assert chain is not None and len(chain.rids) == 3 and not chain.tree
        for rid in chain.rids:  # each leader READs (h) and lends its ring (leader): the hops are NIXL's
            assert ctl.has(keys.nixl_agent(sender.epoch, f"h{rid}")) and ctl.has(owner_key(sender.epoch, rid))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
