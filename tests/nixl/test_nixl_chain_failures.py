"""A NIXL relay chain under failure, through the public surface (``WeightSender(transport='nixl',
cross_host='chain')``, receivers on three simulated hosts, each its host's leader): the middle
leader SIGKILLed, or SIGSTOPped past every timeout, while the tail leader READs the version it is
still writing. The tail applies nothing torn, follows the chain re-formed behind the head, and
everyone is current after (issue 30)."""

from __future__ import annotations

import os
import queue
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from _nixl_workers import remote_receiver_main
from _spawn import CTX
from _workers import Inbox, build, collect, digest, mutate

from lightning_wsync import WeightSender
from lightning_wsync._control.store import Control
from lightning_wsync._planes.nixl.agent import unusable
from lightning_wsync._planes.relay.hops import read_chain

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow,
              pytest.mark.skipif(unusable() is not None, reason=f"{unusable()}")]  # fmt: skip
BIG = ("big", 32)  # eight 4 MiB chunk READs a hop
NAMES = ("h0", "h1", "h2")
TIMEOUT_S, HEARTBEAT_TIMEOUT_S = 4.0, 2.0


class Run:
    """The sender here, three receivers on hosts of their own; every report kept per receiver."""

    def __init__(self, children: Any, port: int, job: str) -> None:
        self.store, self.job = f"127.0.0.1:{port}", job
        self.model = build(BIG)
        self.results = Inbox(CTX)
        self.pushed: dict[int, str] = {}
        self.seen: dict[str, list[tuple[int, str]]] = {n: [] for n in NAMES}
        self.reading: list[tuple[Any, ...]] = []
        self.pids: dict[str, int] = {}
        self.children = children
        self.sender = WeightSender(self.model, store=self.store, job=job, transport="nixl", cross_host="chain",
                                   timeout_s=TIMEOUT_S, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)  # fmt: skip
        for name in NAMES:  # every hop slowed from version 2 on: ~2 s a version, so a kill lands mid-READ
            p = CTX.Process(target=remote_receiver_main, daemon=True, args=(
                self.store, job, name, BIG, self.results.queue(name), {"hop_chunk_delay_s": 0.25}))  # fmt: skip
            p.start()
            children.track(p.pid)
            self.pids[name] = p.pid
        collect(self.results, "ready", set(NAMES), timeout_s=120)

    def push(self, version: int) -> None:
        mutate(self.model, version)
        self.pushed[version] = digest(self.model)
        self.sender.push(version)

    def _drain(self, name: str, timeout_s: float) -> None:
        try:
            msg = self.results.queues[name].get(timeout=timeout_s)
        except queue.Empty:
            return
        assert msg[0] != "error", msg
        if msg[0] == "version":
            self.seen[name].append((msg[2], msg[3]))
        elif msg[0] == "hop-reading":
            self.reading.append(msg)

    def until(self, names: tuple[str, ...], version: int, timeout_s: float) -> None:
        """Wait until each of ``names`` applied ``version`` or newer; every version applied anywhere is bit-exact."""
        deadline = time.monotonic() + timeout_s
        while any(not self.seen[n] or self.seen[n][-1][0] < version for n in names):
            assert time.monotonic() < deadline, f"not all of {names} reached version {version}: {self.seen}"
            for n in NAMES:
                self._drain(n, 0.01)
        for n, seen in self.seen.items():
            assert all(d == self.pushed[v] for v, d in seen), f"{n} applied a version unlike the one pushed: {seen}"

    def tail_reading(self, version: int, timeout_s: float) -> tuple[str, str, str]:
        """(head, middle, tail) by name, once the tail leader READs ``version`` from the middle's draft."""
        ctl = Control(dist.TCPStore("127.0.0.1", int(self.store.rsplit(":", 1)[1]), is_master=False,
                                    timeout=timedelta(seconds=30)), self.job)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            chain = read_chain(ctl, self.sender.epoch)
            if chain is not None and len(chain.rids) == 3:
                by_rid = {m[3]: m[1] for m in self.reading}
                hit = [m for m in self.reading if m[2] == version and m[3] == chain.rids[2] and m[4] == chain.rids[1]]
                if hit and chain.rids[1] in by_rid and chain.rids[0] in by_rid:
                    return by_rid[chain.rids[0]], by_rid[chain.rids[1]], hit[0][1]
            assert time.monotonic() < deadline, f"the tail never READ version {version}: {self.reading}"
            for n in NAMES:
                self._drain(n, 0.01)

    def close(self) -> None:
        self.sender.close()


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_middle_leader_lost_mid_read_the_tail_applies_nothing_torn_and_follows(children, port, stop):
    run = Run(children, port, f"nxf{int(stop)}")
    try:
        run.push(1)
        run.until(NAMES, 1, 120)
        run.push(2)
        head, middle, tail = run.tail_reading(2, 60)  # the tail READs version 2 as the middle still writes it
        os.kill(run.pids[middle], stop)
        # Past every timeout (the hop's, the heartbeat's, the lease's): the chain re-forms behind the head.
        start = time.monotonic()
        run.push(3)
        run.until((head, tail), 3, 60)
        assert time.monotonic() - start < 60
        if stop == signal.SIGSTOP:  # resumed: nothing it held half-read is applied; it follows again
            time.sleep(max(0.0, start + TIMEOUT_S + 1 - time.monotonic()))  # stopped past every timeout, not sync
            os.kill(run.pids[middle], signal.SIGCONT)
        run.push(4)
        live = NAMES if stop == signal.SIGSTOP else (head, tail)
        run.until(live, 4, 90)
        assert {n: run.seen[n][-1] for n in live} == {n: (4, run.pushed[4]) for n in live}
        # Nothing torn: the tail applied version 2 only bit-exact (checked in until) or not at all.
        assert [v for v, _ in run.seen[tail]] in ([1, 2, 3, 4], [1, 3, 4]), run.seen[tail]
    finally:
        run.close()
