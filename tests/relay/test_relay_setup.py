"""Host-mates of a relay host that differ in what they share (issue 21, items 3 and 4).

Each host-mate is a real process told its host by ``WSYNC_HOST_ID``; the trainer (this
process) is on a host of its own, so it relays. Containers are made with ``unshare``: a
PID namespace of its own, or a /dev/shm of its own (full, or just separate). The last
test stalls the host's leader mid-send (SIGSTOP) and times how soon its host-mate is fed.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _workers import build, digest, mutate

from lightning_wsync import WeightSender
from lightning_wsync._control.records import LeaderRecord
from lightning_wsync._control.store import Control
from lightning_wsync._planes.relay.head.feed import leader_record
from lightning_wsync._planes.shm.segment import unlink_segment
from lightning_wsync.testing.procs import Children

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare"),
]
HERE = Path(__file__).resolve().parent
SUPPORT = HERE.parent / "support"
HOST = "relay-host"


def own_dev_shm(size: str | None = None) -> list[str]:
    """Run in a mount namespace with a /dev/shm of its own (``size``: a full one)."""
    options = f"-o size={size} " if size else ""
    return ["unshare", "--mount", "--propagation", "private", "--kill-child", "--", "sh", "-c",
            f'mount -t tmpfs {options}tmpfs /dev/shm && exec "$0" "$@"']  # fmt: skip


def own_pid_namespace() -> list[str]:
    """Run as a PID of its own namespace that names no process here (so: "dead" when judged from here)."""
    unused = next(pid for pid in range(30000, 1000, -1) if not os.path.exists(f"/proc/{pid}"))
    return ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "--", "sh", "-c",
            f'echo {unused - 1} > /proc/sys/kernel/ns_last_pid; "$0" "$@"; exit $?']  # fmt: skip


class Host:
    """Host-mates of one relay host, their events in one file and each one's output in its own."""

    def __init__(
        self, children: Children, tmp: Path, sender: WeightSender, job: str, last: int, spec: str = "mixed,0"
    ) -> None:
        self.children, self.tmp, self.sender, self.job, self.last = children, tmp, sender, job, last
        self.spec = spec  # the host-mates' model (tests/support/_workers.py build()'s spec, as "kind,arg")
        self.events = tmp / "events.jsonl"
        self.ctl = Control(sender.store, job)

    def start(self, name: str, prefix: list[str]) -> int:
        """Start host-mate ``name`` under ``prefix``; its rid once it has registered."""
        path = os.pathsep.join([str(HERE.parents[1]), str(SUPPORT), str(HERE.parent / "multihost")])
        env = {**os.environ, "WSYNC_HOST_ID": HOST, "PYTHONPATH": path}
        # It applies versions until the test ends (a receiver that closes resigns: the record must stay).
        argv = [sys.executable, str(HERE / "_relay_mate.py"), str(self.sender.store_address), self.job, name,
                str(self.events), "1000000", self.spec]  # fmt: skip
        with open(self.tmp / f"{name}.log", "wb") as out:
            proc = subprocess.Popen([*prefix, *argv], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env)  # fmt: skip
        self.children.track(proc.pid)
        ready = self.wait(f"{name} to register", lambda: [e for e in self.read() if e == {**e, "event": "ready",
                                                                                         "name": name}])  # fmt: skip
        return int(ready[0]["rid"])

    def read(self) -> list[dict[str, Any]]:
        text = self.events.read_text() if self.events.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def leader(self) -> LeaderRecord | None:
        return leader_record(self.ctl, self.sender.epoch, HOST)

    def wait(self, what: str, condition: Callable[[], Any], timeout_s: float = 120) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (result := condition()):
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}:\n{p.read_text(errors='replace')[-3000:]}"
                                 for p in self.tmp.glob("*.log"))  # fmt: skip
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{logs}")
            time.sleep(0.05)
        return result

    def push_all(self, model: Any, names: list[str]) -> None:
        """Push 1..last; each must reach every one of ``names`` bit-exact."""
        for version in range(1, self.last + 1):
            mutate(model, version)
            report = self.sender.push(version).wait(timeout_s=60)
            assert sorted(report.delivered) == sorted(names), (report, {n: self.log(n)[-2000:] for n in names})
            want = digest(model)
            self.wait(f"every host-mate to apply version {version}",
                      lambda v=version: {e["name"] for e in self.applied(v)} == set(names))  # fmt: skip
            assert {e["digest"] for e in self.applied(version)} == {want}

    def applied(self, version: int) -> list[dict[str, Any]]:
        return [e for e in self.read() if e["event"] == "applied" and e["version"] == version]


@pytest.fixture
def sender(monkeypatch: pytest.MonkeyPatch, port: int, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    model, job = build(("mixed", 0)), request.node.name[:40]
    with monkeypatch.context() as env:
        env.setenv("WSYNC_HOST_ID", "trainer")
        sender = WeightSender(model, store=f"127.0.0.1:{port}", job=job, timeout_s=10, heartbeat_timeout_s=3)
    with sender:
        yield sender, model, job
    for path in glob.glob(f"/dev/shm/wsync-*-relay-{job[:20]}*"):  # the leaders' rings: SIGKILLed, they left them
        if not path.endswith(".pins"):
            unlink_segment(path)


def test_leader_in_another_pid_namespace_is_judged_by_heartbeat(children, tmp_path, sender) -> None:
    """Item 3: the leader runs in a PID namespace of its own, where its PID names no process
    of its host-mate's namespace. Before: the host-mate found that PID dead and took over,
    then the leader found the host-mate's PID dead and took it back, every poll (the term
    climbed, chains churned). Now the record carries the PID namespace: judged by heartbeat."""
    sender, model, job = sender
    host = Host(children, tmp_path, sender, job, 3)
    inner = host.start("inner", own_pid_namespace())
    host.wait("the inner receiver to lead", lambda: (r := host.leader()) is not None and r.rid == inner)
    host.start("outer", [])
    host.push_all(model, ["inner", "outer"])
    record = host.leader()
    assert record is not None and (record.rid, record.term) == (inner, 0), record
    assert "leads host" not in host.log("outer"), host.log("outer")


def test_host_mates_that_cannot_share_the_ring_are_served_over_the_network(children, tmp_path, sender) -> None:
    """Item 4, both halves, on one host:

    - ``cramped`` leads first, but its /dev/shm is full: it cannot create the host segment.
      Before: it logged a WARNING every 50 ms and kept its record and heartbeat, so nobody
      replaced it and the host received nothing. Now it resigns, says so once, and receives
      over the network; ``main`` takes over.
    - ``isolated`` has a /dev/shm of its own, so it cannot open ``main``'s segment. Before:
      it retried at DEBUG forever and never received. Now it says so once, naming the
      segment, and receives over the network.
    """
    sender, model, job = sender
    host = Host(children, tmp_path, sender, job, 3)
    host.start("cramped", own_dev_shm(size="4k"))
    host.wait("cramped to fail to create the host segment", lambda: "cannot reserve" in host.log("cramped"))
    main = host.start("main", [])
    host.wait("main to lead, its segment created",
              lambda: (r := host.leader()) is not None and r.rid == main and r.ready)  # fmt: skip
    host.start("isolated", own_dev_shm())
    host.push_all(model, ["cramped", "main", "isolated"])
    record = host.leader()
    assert record is not None and record.rid == main, record
    gave_up = [line for line in host.log("cramped").splitlines() if "cannot create the host segment" in line]
    assert len(gave_up) == 1, host.log("cramped")
    assert "cannot reserve" in gave_up[0] and "resigned so that a host-mate leads" in gave_up[0]
    assert "receives over the network from the sender" in gave_up[0]
    cut_off = [line for line in host.log("isolated").splitlines() if "cannot open its leader's" in line]
    assert len(cut_off) == 1, host.log("isolated")
    assert record.shm in cut_off[0] and "WSYNC_HOST_ID" in cut_off[0]


@pytest.mark.timeout(240)
def test_head_leaves_a_send_into_a_stopped_leader_behind(children, tmp_path, monkeypatch, port) -> None:
    """The chain's only leader is SIGSTOPped, then a version too large for the socket buffers
    (32 MiB) is pushed: the head's send into it blocks part-written, and gloo wakes that send
    only at its timeout_s. Once the host-mate has taken over (heartbeat_timeout_s) the head
    must feed the new chain at once. Before: it waited out its send, and the host-mate got
    the version only after timeout_s (30 s here)."""
    timeout_s, heartbeat_timeout_s = 30.0, 2.0
    model, job = build(("big", 32)), "head-leaves-a-send"
    with monkeypatch.context() as env:
        env.setenv("WSYNC_HOST_ID", "trainer")
        sender = WeightSender(model, store=f"127.0.0.1:{port}", job=job, timeout_s=timeout_s,
                              heartbeat_timeout_s=heartbeat_timeout_s, delta="off")  # fmt: skip
    with sender:
        host = Host(children, tmp_path, sender, job, 1, spec="big,32")
        rids = {host.start(name, []): name for name in ("a", "b")}
        host.push_all(model, ["a", "b"])
        record = host.wait("a leader", host.leader)
        stalled, mate = rids[record.rid], rids[next(r for r in rids if r != record.rid)]
        os.kill(record.pid, signal.SIGSTOP)
        try:
            mutate(model, 2)
            pushed = time.monotonic()
            sender.push(2)
            host.wait(f"{mate} to apply version 2", lambda: [e for e in host.applied(2) if e["name"] == mate],
                      timeout_s=2 * timeout_s)  # fmt: skip
            took_s = time.monotonic() - pushed
        finally:
            os.kill(record.pid, signal.SIGCONT)
        assert [e["digest"] for e in host.applied(2)] == [digest(model)]
        print(f"{mate} held version 2 {took_s:.2f} s after the push")
        # heartbeat_timeout_s for the host-mate to take over, then one 32 MiB send on loopback
        assert took_s < timeout_s / 2, (took_s, host.log(mate)[-3000:])
        new = host.leader()
        assert new is not None and rids[new.rid] == mate, new
        mutate(model, 3)
        sender.push(3)  # the resumed leader has stepped down, and reads the host-mate's ring
        host.wait("both to apply version 3", lambda: {e["name"] for e in host.applied(3)} == {stalled, mate},
                  timeout_s=timeout_s)  # fmt: skip
        assert {e["digest"] for e in host.applied(3)} == {digest(model)}
