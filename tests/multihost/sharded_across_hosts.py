"""Scenario: a sharded push from a trainer of 2 ranks on 2 simulated hosts to receivers on 4 others.

Hosts 0 and 1 run trainer ranks 0 and 1 (rank 0: this process, the WeightSender with the
store; rank 1: ``_shard_rank.py``), each holding the whole model as DDP replicas do and
relaying only its share; hosts 2-5 run one receiver each (``_relay_receiver.py``). Every
applied version's digest is checked against the trainer's.

Each mode runs two phases on the same hosts and receivers (one set-up for two tests); the
result holds each phase's figures under its name.

- ``egress+delta``: ``egress``: pushes 1-4; the bytes each host sent and received over pushes
  2-4 (push 1 sets up the hops), read from each namespace's ``eth0`` counters. Then the
  trainer is relaunched (a new sender epoch, a new rank 1, both replicas rebuilt from the
  seed) for ``delta``: the same with ``delta="always"`` on both ranks and sparse steps (2% of
  each tensor), pushes 5-8: each rank encodes its own share's delta, so pushes 6-8 move a few
  percent.
- ``kill+stop``: ``kill``: pushes 1-2, then rank 1 is SIGKILLed while its share of version 3
  is on the wire (host 1's link is shaped so that it takes a while), rank 0 pushes 3 and 4
  alone; then the trainer is relaunched (a new sender epoch, a new rank 1) and pushes 5. No
  receiver may apply 3 or 4, and every receiver must apply 5, bit-exact. Then ``stop``: the
  same with rank 1 SIGSTOPped mid-share of version 6 (a stall past every timeout), rank 0
  pushing 6 and 7 alone, and the relaunched trainer pushing 8.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _scenario import Procs, main, wait_until

from lightning_wsync import SenderConfig, WeightSender
from lightning_wsync._control import keys
from lightning_wsync._control.records import ChainRecord
from lightning_wsync._control.store import Control
from lightning_wsync._push.report import PushHandle
from lightning_wsync._push.shares import prepare_shares
from lightning_wsync.testing.hosts import SimHosts
from lightning_wsync.testing.models import build_model, digest, mutate, spec_for_size, touch
from lightning_wsync.testing.stores import host_store

HERE = Path(__file__).resolve().parent
JOB = "xshard"
ROLLOUT = (2, 3, 4, 5)


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class Trainer:
    """Rank 0 here, rank 1 on host 1; one launch is one sender epoch."""

    def __init__(
        self, hosts: SimHosts, procs: Procs, store: dist.TCPStore, address: str, size_mb: float, delta: str = "auto"
    ) -> None:  # fmt: skip
        self.hosts, self.procs, self.store, self.address, self.size_mb = hosts, procs, store, address, size_mb
        self.model = build_model(spec_for_size(size_mb), seed=0)
        # A leader silent this long leaves its chains (a resend would skew the byte counts): ample on 2 busy cores.
        self.cfg = SenderConfig(job=JOB, timeout_s=10.0, heartbeat_timeout_s=6.0, delta=delta)
        self.change = touch if delta == "always" else mutate  # a sparse step where the test wants deltas
        self.mutated = 0
        self.launch = 0
        self.rank1: dict[str, Any] = {}
        self.asked = 0  # push keys set for the current rank 1

    def rebuild(self, delta: str) -> None:
        """The model from the seed again and ``delta`` from the next launch (rank 1 builds its replica
        from the seed at each launch and takes every step up to the version asked)."""
        self.model = build_model(spec_for_size(self.size_mb), seed=0)
        self.cfg = dataclasses.replace(self.cfg, delta=delta)
        self.change = touch if delta == "always" else mutate
        self.mutated = 0

    def start(self) -> WeightSender:
        self.launch += 1
        self.asked = 0
        argv = [sys.executable, str(HERE / "_shard_rank.py"), "--store", self.address, "--job", JOB,
                "--launch", str(self.launch), "--size-mb", str(self.size_mb), "--timeout-s", str(self.cfg.timeout_s),
                "--delta", self.cfg.delta]
        self.procs.start(f"rank1-l{self.launch}", 1, argv)  # fmt: skip
        self.rank1 = json.loads(self.store.get(f"xs/{self.launch}/rank1"))
        mine = prepare_shares(self.model, self.cfg, 0, 2)
        plan = mine.plan.with_segments(["", self.rank1["name"]], [self.hosts.name(0), self.rank1["host"]])
        shares = dataclasses.replace(mine, plan=plan)
        sender = WeightSender(self.model, store=self.store, config=self.cfg, shares=shares)
        self.store.set(f"xs/{self.launch}/epoch", str(sender.epoch))
        return sender

    def step(self, version: int) -> str:
        """Both replicas take the optimizer steps up to ``version``; its digest."""
        for step in range(self.mutated + 1, version + 1):
            self.change(self.model, step)
        self.mutated = version
        return digest(self.model, None)

    def ask_rank1(self, version: int) -> None:
        self.asked += 1
        self.store.set(f"xs/{self.launch}/push/{self.asked}", str(version))

    def rank1_wrote(self, version: int) -> bool:
        key = f"xs/{self.launch}/wrote/{version}"
        return self.store.check([key]) and self.store.get(key) == b"1"

    def stop_rank1(self) -> None:
        self.ask_rank1(0)
        self.procs.wait(f"rank1-l{self.launch}", 30)


def scenario(argv: list[str]) -> dict[str, Any]:
    out, mode, size_mb = Path(argv[0]), argv[1], float(argv[2])
    assert mode in ("egress+delta", "kill+stop"), mode
    events = out / "events.jsonl"
    with SimHosts(2 + len(ROLLOUT)) as hosts:
        if mode == "kill+stop":
            # rank 1's share of a version takes ~1.7 s on its link: the kill, once 30% of it left, lands
            # mid-share even when polling the host's counters (a subprocess each) is slow under load
            hosts.shape(1, "40mbit")
        os.environ["WSYNC_HOST_ID"] = hosts.name(0)
        hosts.enter(0)
        store = host_store(hosts.address(0), 0, timeout_s=60)
        address = f"{hosts.address(0)}:{store.port}"
        procs = Procs(hosts, out)
        trainer = Trainer(hosts, procs, store, address, size_mb)
        sender = trainer.start()
        names = [f"h{h}r0" for h in ROLLOUT]
        for name, h in zip(names, ROLLOUT):
            procs.start(name, h, [sys.executable, str(HERE / "_relay_receiver.py"), "--store", address, "--job", JOB,
                                  "--name", name, "--size-mb", str(size_mb), "--events", str(events)])  # fmt: skip
        wait_until("every receiver to register", lambda: set(names) <= set(sender.receivers()), 120, procs)
        ctl = Control(store, JOB)

        def chains_formed() -> bool:  # pushing while the chains grow makes hops wait out timeout_s
            streams = [keys.relay_stream(sender.epoch, rank) for rank in (0, 1)]
            records = [ctl.get_record(keys.relay_chain(stream), ChainRecord) for stream in streams]
            return all(c is not None and len(c.rids) == len(ROLLOUT) for c in records)

        wait_until("both streams' chains to take in every rollout host", chains_formed, 60, procs)
        expected: dict[int, str] = {}

        def applied(version: int) -> set[str]:
            return {r["name"] for r in read(events) if r["event"] == "applied" and r["version"] == version}

        def push(version: int, *, rank1: bool = True) -> PushHandle:
            expected[version] = trainer.step(version)
            if rank1:
                trainer.ask_rank1(version)
                wait_until(f"rank 1 to write version {version}", lambda: trainer.rank1_wrote(version), 30, procs)
            return sender.push(version)

        def everyone(version: int) -> None:
            push(version)
            wait_until(f"every receiver to apply version {version}", lambda: applied(version) >= set(names), 60, procs)

        def traffic(first: int) -> dict[str, list[float]]:
            """Pushes ``first``..``first + 3`` to everyone; each host's bytes sent and received per push
            over the last three (the first sets up the hops)."""
            everyone(first)
            before = [hosts.counters(i) for i in range(hosts.n)]
            for version in range(first + 1, first + 4):
                everyone(version)
            after = [hosts.counters(i) for i in range(hosts.n)]
            return {"versions": list(range(first, first + 4)),
                    "tx_per_push": [(a[0] - b[0]) / 3 for a, b in zip(after, before)],
                    "rx_per_push": [(a[1] - b[1]) / 3 for a, b in zip(after, before)]}  # fmt: skip

        def relaunch(delta: str | None = None) -> None:
            """A new sender epoch and a new rank 1 (the old one ended or killed); with ``delta``,
            rank 1 ended by its ask and both replicas rebuilt for that setting."""
            nonlocal sender
            sender.close(0, final=False)  # as after a crash (or a restart): training goes on
            if delta is not None:
                trainer.stop_rank1()
                trainer.rebuild(delta)
            sender = trainer.start()
            wait_until("both streams' chains of the new epoch to take in every rollout host", chains_formed, 60, procs)

        def lose_rank1(first: int, sig: signal.Signals) -> dict[str, Any]:
            """Pushes ``first`` and ``first + 1`` to everyone, then rank 1 is stopped by ``sig`` mid-share
            of ``first + 2``; rank 0 pushes ``first + 3`` alone; the trainer is relaunched and pushes
            ``first + 4`` to everyone."""
            for version in (first, first + 1):
                everyone(version)
            killed, cut = stop_rank1_mid_share(hosts, trainer, push, shares, procs, sig, first + 2)
            # Rank 0 alone pushes the next: its share reaches every host, rank 1's never does.
            rx = [hosts.counters(h)[1] for h in ROLLOUT]
            alone = push(first + 3, rank1=False)
            wait_until(f"rank 0's share of version {first + 3} to reach every rollout host",
                       lambda: all(hosts.counters(h)[1] >= b + shares[0] for h, b in zip(ROLLOUT, rx)), 30, procs)
            # Each push report (at most timeout_s on) says why each receiver lacks the version: rank 1's share.
            reports = {str(handle.version): handle.wait().failed for handle in (cut, alone)}
            os.kill(int(trainer.rank1["pid"]), signal.SIGKILL)  # a stalled rank 1 too: the trainer is relaunched
            procs.wait(f"rank1-l{trainer.launch}", 30)
            return {"killed": killed, "partial": (first + 2, first + 3), "relaunched": first + 4, "failed": reports}

        shares = [prepare_shares(trainer.model, trainer.cfg, r, 2).share.total_bytes for r in (0, 1)]
        result: dict[str, Any] = {"names": names, "share_bytes": shares, "model_bytes": sender.layout.total_bytes}
        phases: dict[str, dict[str, Any]] = {}
        if mode == "egress+delta":
            phases["egress"] = traffic(1)
            relaunch(delta="always")  # both replicas from the seed: rank 1 steps from it too
            phases["delta"] = traffic(5)
        else:
            phases["kill"] = lose_rank1(1, signal.SIGKILL)
            relaunch()
            everyone(5)
            phases["stop"] = lose_rank1(6, signal.SIGSTOP)
            relaunch()
            everyone(10)
        sender.close()
        trainer.stop_rank1()
        every = [{"name": r["name"], "version": r["version"], "exact": r["digest"] == expected.get(r["version"])}
                 for r in read(events) if r["event"] == "applied"]  # fmt: skip
        for name, phase in phases.items():
            if "partial" in phase:  # who applied a version rank 1 never finished: nobody
                cut = phase["partial"]
                phase["partial_applied"] = sorted(f"{a['name']}@{a['version']}" for a in every if a["version"] in cut)
            result[name] = phase
        result["applied"] = every
        return result


def stop_rank1_mid_share(
    hosts: SimHosts, trainer: Trainer, push: Any, shares: list[int], procs: Procs, sig: signal.Signals, version: int
) -> tuple[dict[str, Any], PushHandle]:
    """Rank 1 SIGKILLed (or SIGSTOPped) once 30% of its share of ``version`` has left its host; the push's handle."""
    tx = hosts.counters(1)[0]
    handle = push(version)
    goal = tx + 0.3 * shares[1]
    wait_until("30% of rank 1's share of version 3 to leave host 1", lambda: hosts.counters(1)[0] >= goal, 30, procs)
    os.kill(int(trainer.rank1["pid"]), sig)
    return {"sent_bytes": hosts.counters(1)[0] - tx, "share_bytes": shares[1], "signal": sig.name}, handle


if __name__ == "__main__":
    main(scenario)
