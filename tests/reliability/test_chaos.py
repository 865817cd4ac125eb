"""Chaos: pushes while receivers are killed mid-transfer, restarted, joined late and stalled.

Reduced scale by default; the full run (100 pushes per transport) is

    WSYNC_CHAOS_FULL=1 .venv/bin/python -m pytest -m chaos tests/reliability/test_chaos.py
"""

from __future__ import annotations

import os
import queue
import random
import signal
import time
from typing import Any

import pytest
from _spawn import CTX
from _workers import build, digest, mutate, receiver_main

from lightning_wsync import WeightSender

FULL = os.environ.get("WSYNC_CHAOS_FULL") == "1"
PUSHES = 100 if FULL else 12
pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(1800 if FULL else 300)]
TIMEOUT_S = 3.0
CATCH_UP_S = 90.0  # bound on a live receiver holding the newest version (includes a cold start)


class Fleet:
    """Receiver processes with their own report queues; checks every applied version."""

    def __init__(
        self, children: Any, store: str, job: str, spec: tuple[str, int], digests: dict[int, str], **options: Any
    ) -> None:
        self.children, self.store, self.job, self.spec, self.digests = children, store, job, spec, digests
        self.options = options
        self.procs: dict[str, Any] = {}
        self.queues: dict[str, Any] = {}
        self.held: dict[str, int] = {}
        self.stopped: set[str] = set()
        self.applied = 0
        self.count = 0

    def start(self) -> str:
        name = f"r{self.count}"
        self.count += 1
        q = CTX.Queue()
        args = (self.store, self.job, name, self.spec, q, self.options)
        p = CTX.Process(target=receiver_main, args=args, daemon=True)
        p.start()
        self.children.track(p.pid)
        self.procs[name], self.queues[name], self.held[name] = p, q, -1
        return name

    def kill(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].join(timeout=10)
        del self.procs[name], self.held[name]

    def live(self) -> list[str]:
        return [n for n in self.procs if n not in self.stopped]

    def drain(self, name: str, wait_s: float) -> None:
        try:
            msg = self.queues[name].get(timeout=wait_s)
        except queue.Empty:
            return
        assert msg[0] != "error", msg
        if msg[0] == "version":
            version, got = msg[2], msg[3]
            assert got == self.digests[version], f"{name} applied a torn or wrong version {version}"
            self.held[name] = max(self.held[name], version)
            self.applied += 1

    def wait_all_hold(self, version: int) -> None:
        deadline = time.monotonic() + CATCH_UP_S
        for name in self.live():
            while self.held[name] < version:
                assert time.monotonic() < deadline, f"{name} holds {self.held[name]}, not {version}"
                self.drain(name, 0.05)


@pytest.mark.parametrize("transport,apply", [("auto", "copy"), ("gloo", "copy"), ("gloo", "swap")])
def test_chaos(children, port, transport, apply):
    rng = random.Random(1234)
    spec = ("big", 16)
    model = build(spec)
    digests: dict[int, str] = {}
    store = f"127.0.0.1:{port}"
    with WeightSender(model, store=store, job="chaos", transport=transport, timeout_s=TIMEOUT_S) as sender:
        fleet = Fleet(children, store, "chaos", spec, digests, apply=apply)
        for _ in range(3):
            fleet.start()
        stalled: tuple[str, float] | None = None
        kills = late = stalls = 0
        for version in range(1, PUSHES + 1):
            mutate(model, version)
            digests[version] = digest(model)
            handle = sender.push(version)
            assert handle.stall_s < 1.0
            action = {1: 1.0, 3: 0.5}.get(version, rng.random())  # push 3 always stalls someone
            if action < 0.35 and len(fleet.live()) > 1:
                fleet.kill(rng.choice(fleet.live()))  # mid-transfer: the push is in flight
                fleet.start()
                kills += 1
            elif action < 0.45:
                fleet.start()  # a late joiner
                late += 1
            elif action < 0.55 and stalled is None and len(fleet.live()) > 1:
                name = rng.choice(fleet.live())
                os.kill(fleet.procs[name].pid, signal.SIGSTOP)
                fleet.stopped.add(name)
                stalled = (name, time.monotonic())
                stalls += 1
            started = time.monotonic()
            report = handle.wait(timeout_s=TIMEOUT_S)
            assert time.monotonic() - started <= TIMEOUT_S + 2.0, "the sender blocked past timeout_s"
            assert report.version == version
            if stalled is not None and time.monotonic() - stalled[1] > 2 * TIMEOUT_S:
                os.kill(fleet.procs[stalled[0]].pid, signal.SIGCONT)  # resumed after > timeout_s
                fleet.stopped.discard(stalled[0])
                stalled = None
            fleet.wait_all_hold(version)
        if stalled is not None:
            os.kill(fleet.procs[stalled[0]].pid, signal.SIGCONT)
            fleet.stopped.discard(stalled[0])
        fleet.wait_all_hold(PUSHES)  # the resumed one catches up too
        assert kills >= 2 and late >= 1 and stalls >= 1 and fleet.applied >= PUSHES
        print(f"chaos[{transport}, apply={apply}]: {PUSHES} pushes, {kills} kills, {late} late joins, {stalls} stalls, "
              f"{fleet.applied} applies checked, 0 torn")
