"""A NIXL relay under test, through the public surface: a ``WeightSender(transport='nixl')`` in the
test's process, receivers on simulated hosts of their own (child processes, ``remote_receiver_main``),
every report kept per receiver (tests/nixl: a chain's or a tree's failures, garbled hop records)."""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from _nixl_workers import remote_receiver_main
from _spawn import CTX
from _workers import Inbox, build, collect, digest, mutate, receiver_main

from lightning_wsync import WeightSender
from lightning_wsync._control.records import ChainRecord
from lightning_wsync._control.store import Control
from lightning_wsync._planes.nixl.agent import unusable
from lightning_wsync._planes.relay.hops import read_chain
from lightning_wsync._planes.shm.files import SHM_DIR

SLOW_NIXL = [pytest.mark.timeout(300), pytest.mark.slow,
             pytest.mark.skipif(unusable() is not None, reason=f"{unusable()}")]  # fmt: skip
"""The marks of a multi-process NIXL test: skipped, saying why, where NIXL is not usable."""
BIG = ("big", 32)  # eight 4 MiB chunk READs a hop
LOST = pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
"""A leader lost: SIGKILLed, or SIGSTOPped (and SIGCONTed later)."""


class Run:
    """The sender here; receivers started with :meth:`start`; every version each applied, every hop READ
    reported (``hop-reading``), every log line forwarded (``log``) and every receiver's leftovers (``left``)."""

    def __init__(self, children: Any, port: int, job: str, spec: tuple[str, int], **sender: Any) -> None:
        self.store, self.job, self.spec = f"127.0.0.1:{port}", job, spec
        self.model = build(spec)
        self.results = Inbox(CTX)
        self.pushed: dict[int, str] = {}
        self.seen: dict[str, list[tuple[int, str]]] = {}
        self.reading: list[tuple[Any, ...]] = []  # ("hop-reading", name, version, rid, upstream rid, slot, seq)
        self.published: list[tuple[Any, ...]] = []  # ("hop-published", name, version, slot, seq)
        self.logs: list[tuple[Any, ...]] = []  # ("log", name, level, message)
        self.left: dict[str, tuple[Any, ...]] = {}  # ("left", name, wsync threads, open NIXL agents)
        self.procs: dict[str, Any] = {}
        self.children = children
        self.sender = WeightSender(self.model, store=self.store, job=job, transport="nixl", **sender)
        self.ctl = Control(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)), job)

    def start(self, names: tuple[str, ...], options: dict[str, Any], *, local: bool = False) -> None:
        """Receivers on hosts of their own (``local``: on the sender's host, ``options`` for ``WeightReceiver``)."""
        target = receiver_main if local else remote_receiver_main
        for name in names:
            args = (self.store, self.job, name, self.spec, self.results.queue(name), dict(options))
            p = CTX.Process(target=target, daemon=True, args=args)
            p.start()
            self.children.track(p.pid)
            self.procs[name] = p
            self.seen[name] = []
        collect(self.results, "ready", set(names), timeout_s=120)

    def push(self, version: int) -> None:
        mutate(self.model, version)
        self.pushed[version] = digest(self.model)
        self.sender.push(version)

    def drain(self, timeout_s: float = 0.01) -> None:
        for name, q in self.results.queues.items():
            try:
                msg = q.get(timeout=timeout_s)
            except queue.Empty:
                continue
            assert msg[0] != "error", msg
            if msg[0] == "version":
                self.seen[name].append((msg[2], msg[3]))
            elif msg[0] == "hop-reading":
                self.reading.append(msg)
            elif msg[0] == "hop-published":
                self.published.append(msg)
            elif msg[0] == "log":
                self.logs.append(msg)
            elif msg[0] == "left":
                self.left[name] = msg

    def wait(self, done: Callable[[], Any], timeout_s: float, what: str) -> Any:
        """Drain reports until ``done()`` is truthy (its value), at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not (got := done()):
            assert time.monotonic() < deadline, f"{what} within {timeout_s} s: applied {self.seen}"
            self.drain()
        return got

    def until(self, names: tuple[str, ...], version: int, timeout_s: float) -> float:
        """Wait until each of ``names`` applied ``version`` or newer (the seconds it took); every version
        applied anywhere is the one pushed, bit-exact."""
        start = time.monotonic()
        self.wait(lambda: all(self.seen[n] and self.seen[n][-1][0] >= version for n in names), timeout_s,
                  f"not all of {names} reached version {version}")  # fmt: skip
        for n, seen in self.seen.items():
            assert all(d == self.pushed[v] for v, d in seen), f"{n} applied a version unlike the one pushed: {seen}"
        return time.monotonic() - start

    def chain(self, leaders: int, timeout_s: float) -> ChainRecord:
        """The relay's chain (or tree) once it names ``leaders`` leaders."""
        return self.wait(lambda: (c := read_chain(self.ctl, self.sender.epoch)) is not None
                         and len(c.rids) == leaders and c, timeout_s, f"no chain of {leaders} leaders")  # fmt: skip

    def names(self) -> dict[int, str]:
        """Each leader's rid -> its receiver's name, as their hops said."""
        return {m[3]: m[1] for m in self.reading}

    def hop_reading(self, version: int, rid: int, upstream: int | None, timeout_s: float) -> tuple[Any, ...]:
        """The report of leader ``rid`` READing ``version`` from ``upstream`` (None: the trainer)."""
        return self.wait(lambda: next((m for m in self.reading if m[2:5] == (version, rid, upstream)), None),
                         timeout_s, f"leader {rid} never READ version {version} from {upstream}")  # fmt: skip

    def close(self, names: tuple[str, ...]) -> None:
        """Close the sender: each receiver of ``names`` closes with no wsync thread and no NIXL agent left and
        exits 0; nothing of the job is left in shared memory but the segments of processes killed."""
        self.sender.close()
        self.wait(lambda: set(names) <= set(self.left), 60, f"receivers {names} did not close")
        for name in names:
            assert self.left[name][2:] == ([], []), self.left[name]  # threads, agents
            self.procs[name].join(timeout=30)
            assert self.procs[name].exitcode == 0, (name, self.procs[name].exitcode)

    def garble(self, key: str, value: bytes | None = b"\x00garbage") -> bytes:
        """Set the job's ``key`` to ``value`` (None: leave it) on the store; what it held before."""
        before = bytes(self.ctl.store.get(key))
        if value is not None:
            self.ctl.store.set(key, value)
        return before

    def said(self, name: str, text: str, level: str | None = None) -> list[str]:
        """What ``name`` logged (at ``level``) that contains ``text``."""
        return [m[3] for m in self.logs if m[1] == name and text in m[3] and level in (None, m[2])]

    def segments(self) -> list[str]:
        """This job's shared-memory segments (and pin directories) still in ``/dev/shm``."""
        return sorted(n for n in os.listdir(SHM_DIR) if n.removesuffix(".pins").endswith(f"-{self.job}"))
