"""A relay host's leader beats and acknowledges for its host-mates (issue 22): what the sender
concludes about each receiver stays true when the leader or a host-mate fails.

Each receiver is a process of its own on one simulated host (``WSYNC_HOST_ID``); the trainer
(this process) is on another, so it relays. The sender's view is sampled every 20 ms through
``sender.receivers()`` (the receivers it considers live: neither gone nor silent past
``heartbeat_timeout_s``).

- a host-mate SIGKILLed: its leader passes no more of its beats on, so the sender declares it
  gone within ``heartbeat_timeout_s``; the others stay live.
- the leader SIGSTOPped past ``heartbeat_timeout_s``: its host-mates' notes stop being passed
  on, they beat on the store themselves, and none is declared gone; once it is let go on,
  every version reaches everyone bit-exact, and nobody had to register again.
- the leader SIGKILLed: a host-mate takes over; nobody alive is declared gone.
- a host-mate SIGSTOPped until the sender forgot it (deleted its keys): let go on, it registers
  again, and its leader never writes the forgotten receiver's keys back.
"""

from __future__ import annotations

import json
import os
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
from lightning_wsync._control import keys
from lightning_wsync._control.records import LeaderRecord
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import timing
from lightning_wsync._planes.relay.head.feed import leader_record
from lightning_wsync.testing.procs import Children

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]  # 240 s of it for starting the processes, at most
HERE = Path(__file__).resolve().parent
HOST = "beat-host"
HEARTBEAT_TIMEOUT_S = 3.0
NAMES = ["a", "b", "c"]
FORGOTTEN = "was forgotten by the sender"  # a receiver's warning when it has to register again


class Host:
    """Receivers of one relay host, each a process; their events in one file, their output in one each."""

    def __init__(self, children: Children, tmp: Path, sender: WeightSender, job: str) -> None:
        self.children, self.tmp, self.sender, self.job = children, tmp, sender, job
        self.events = tmp / "events.jsonl"
        self.ctl = Control(sender.store, job)
        self.pids: dict[str, int] = {}
        self.rids: dict[int, str] = {}

    def start(self, name: str) -> None:
        path = os.pathsep.join([str(HERE.parents[1]), str(HERE.parent / "support"), str(HERE.parent / "multihost")])
        env = {**os.environ, "WSYNC_HOST_ID": HOST, "PYTHONPATH": path}
        argv = [sys.executable, str(HERE / "_relay_mate.py"), str(self.sender.store_address), self.job, name,
                str(self.events), "1000000"]  # fmt: skip
        with open(self.tmp / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.children.track(proc.pid)
        self.pids[name] = proc.pid

    def registered(self) -> None:
        # Three Python processes importing torch at once on a loaded machine (2 cores, load 25-40)
        # took more than 90 s (issue 32: the set-up error, every log empty); that is start-up, not
        # the library: it gets a bound of its own, and registering keeps its 90 s from there.
        def imported() -> bool:
            return {e["name"] for e in self.read() if e["event"] == "imported"} >= set(self.pids)

        self.wait("every receiver process to import torch and the library", imported, timeout_s=240)
        self.wait("every receiver to register", lambda: len(self._ready()) == len(self.pids))
        self.rids = {int(e["rid"]): e["name"] for e in self._ready()}

    def _ready(self) -> list[dict[str, Any]]:
        return [e for e in self.read() if e["event"] == "ready"]

    def read(self) -> list[dict[str, Any]]:
        text = self.events.read_text() if self.events.exists() else ""
        return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]  # whole lines

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}:\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp.glob("*.log"))

    def leader(self) -> LeaderRecord | None:
        return leader_record(self.ctl, self.sender.epoch, HOST)

    def wait(self, what: str, condition: Callable[[], Any], timeout_s: float = 90) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (result := condition()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{self.logs()}")
            time.sleep(0.05)
        return result

    def push(self, model: Any, version: int, names: list[str], reported: bool = True) -> None:
        """Push ``version``: its report lists each of ``names`` as holding it (unless not ``reported``);
        each applied it bit-exact."""
        mutate(model, version)
        report = self.sender.push(version).wait(timeout_s=60)
        if reported:
            assert set(names) <= set(report.delivered), (report, self.logs())
        want = digest(model)
        self.wait(f"{names} to apply version {version}",
                  lambda: {e["name"] for e in self.applied(version)} >= set(names))  # fmt: skip
        assert {e["digest"] for e in self.applied(version)} == {want}

    def applied(self, version: int) -> list[dict[str, Any]]:
        return [e for e in self.read() if e["event"] == "applied" and e["version"] == version]

    def forgotten(self) -> list[str]:
        return [n for n in self.pids if FORGOTTEN in (self.tmp / f"{n}.log").read_text(errors="replace")]


def watch(sender: WeightSender, seconds: float, until: Callable[[set[str]], bool] | None = None) -> list[set[str]]:
    """The sender's live receivers every 20 ms for ``seconds`` (or until ``until`` holds)."""
    samples: list[set[str]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        samples.append(set(sender.receivers()))
        if until is not None and until(samples[-1]):
            break
        time.sleep(0.02)  # a sampling period, not a synchronisation
    return samples


@pytest.fixture
def host(children, tmp_path, monkeypatch, port, request):  # type: ignore[no-untyped-def]
    model, job = build(("mixed", 0)), request.node.name[:40]
    with monkeypatch.context() as env:
        env.setenv("WSYNC_HOST_ID", "trainer")
        sender = WeightSender(model, store=f"127.0.0.1:{port}", job=job, timeout_s=10,
                              heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)  # fmt: skip
    names = getattr(request, "param", NAMES)  # parametrized indirectly: fewer host-mates
    with sender:
        host = Host(children, tmp_path, sender, job)
        for name in names:
            host.start(name)
        host.registered()
        # The set-up's push is the first for processes just started (rings created, pages touched):
        # under CI's load a host-mate's beat once reached the sender 3.0 s late during it and the
        # report failed it (stop 39). What the tests are about starts after it: here each receiver
        # must apply the version bit-exact and then be seen live, whatever the report said.
        host.wait("the sender to see them all live", lambda: set(sender.receivers()) == set(names))
        host.push(model, 1, names, reported=False)
        host.wait("the sender to see them all live", lambda: set(sender.receivers()) == set(names))
        yield host, model
        for pid in host.pids.values():  # a SIGSTOPped one is let go on before it is killed
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_a_killed_host_mate_is_declared_gone_in_time_and_the_others_stay_live(host) -> None:
    host, model = host
    leader = host.wait("a leader", host.leader)
    victim = next(n for r, n in host.rids.items() if r != leader.rid)
    others = [n for n in NAMES if n != victim]
    os.kill(host.pids[victim], signal.SIGKILL)
    killed = time.monotonic()
    samples = watch(host.sender, 3 * HEARTBEAT_TIMEOUT_S, until=lambda live: victim not in live)
    took_s = time.monotonic() - killed
    assert victim not in samples[-1], f"{victim} still live {took_s:.1f} s after SIGKILL\n{host.logs()}"
    # heartbeat_timeout_s from its last beat (a quarter of it before the kill at most), as before
    assert took_s <= HEARTBEAT_TIMEOUT_S + 1.0, took_s
    later = watch(host.sender, 2 * HEARTBEAT_TIMEOUT_S)
    assert all(set(others) <= live for live in samples + later), [s for s in samples + later if set(others) - s]
    assert all(victim not in live for live in later), later
    host.push(model, 2, others)
    assert not host.forgotten(), host.logs()


def hit_the_leader(host: Host, how: signal.Signals) -> tuple[LeaderRecord, list[set[str]]]:
    """Send ``how`` to the host's leader, then watch the sender for 2.5 heartbeat timeouts
    (SIGSTOP: the leader is let go on after that): none of its host-mates may drop out."""
    leader = host.wait("a leader", host.leader)
    mates = [n for r, n in host.rids.items() if r != leader.rid]
    os.kill(leader.pid, how)
    try:
        samples = watch(host.sender, 2.5 * HEARTBEAT_TIMEOUT_S)
    finally:
        if how == signal.SIGSTOP:
            os.kill(leader.pid, signal.SIGCONT)
    assert all(set(mates) <= live for live in samples), ([s for s in samples if set(mates) - s], host.logs())
    return leader, samples


def test_a_leader_stopped_past_the_heartbeat_timeout_costs_its_host_mates_nothing(host) -> None:
    host, model = host
    leader, samples = hit_the_leader(host, signal.SIGSTOP)
    stopped = host.rids[leader.rid]
    assert any(stopped not in live for live in samples)  # the stopped one itself is silent
    host.wait("the stopped leader to beat again", lambda: stopped in host.sender.receivers(),
              timeout_s=4 * HEARTBEAT_TIMEOUT_S)  # fmt: skip
    for version in (2, 3):
        host.push(model, version, NAMES)
    later = watch(host.sender, HEARTBEAT_TIMEOUT_S)
    assert all(set(NAMES) <= live for live in later), later
    assert not host.forgotten(), host.logs()


def test_a_killed_leader_is_replaced_and_nobody_alive_is_declared_gone(host) -> None:
    host, model = host
    leader, _ = hit_the_leader(host, signal.SIGKILL)
    killed = host.rids[leader.rid]
    mates = [n for n in NAMES if n != killed]
    new = host.wait("a host-mate to take over", lambda: (r := host.leader()) is not None and r.rid != leader.rid and r)
    assert host.rids[new.rid] in mates
    host.push(model, 2, mates)
    later = watch(host.sender, HEARTBEAT_TIMEOUT_S)
    assert all(set(mates) <= live and killed not in live for live in later), later
    assert not host.forgotten(), host.logs()


def test_a_host_mate_forgotten_while_stopped_registers_again_and_stays_forgotten(host, monkeypatch) -> None:
    host, model = host
    monkeypatch.setattr("lightning_wsync._push.membership._FORGET_AFTER", 2)  # forgotten after 3 timeouts
    leader = host.wait("a leader", host.leader)
    old, stopped = next((r, n) for r, n in host.rids.items() if r != leader.rid)
    others = [n for n in NAMES if n != stopped]
    os.kill(host.pids[stopped], signal.SIGSTOP)
    try:
        forgotten = lambda _: host.ctl.get_text(keys.member(old)) is None  # noqa: E731
        samples = watch(host.sender, 6 * HEARTBEAT_TIMEOUT_S, until=forgotten)
        assert host.ctl.get_text(keys.member(old)) is None, "the sender did not forget the stopped receiver"
    finally:
        os.kill(host.pids[stopped], signal.SIGCONT)
    assert all(set(others) <= live for live in samples), [s for s in samples if set(others) - s]
    host.wait(f"{stopped} to register again", lambda: stopped in host.forgotten())
    assert host.forgotten() == [stopped], host.logs()
    host.push(model, 2, NAMES)
    later = watch(host.sender, 2 * HEARTBEAT_TIMEOUT_S)
    assert all(set(NAMES) <= live for live in later), later
    left = {key: host.ctl.get_text(key) for key in (keys.member_heartbeat(old), keys.member_state(old))}
    assert set(left.values()) == {None}, left


def test_a_garbled_leader_record_is_replaced_once_and_leadership_stays_put(host) -> None:
    """Issue 32 (chaos with garbage, seed 32): after a host's leader record was overwritten with
    junk, old code took over from it at term 0 and rang nobody (the leader it replaced kept
    serving on what its bell last read). Now the record is replaced once (its leader, which reads
    it again at the latest when its bell's backstop rings, takes it back), the term goes on, nobody
    takes the host from anyone afterwards, and everyone gets the next versions bit-exact.

    Noticed within a beat period (issue 32, round 4): nobody read the record sooner than the
    leader's bell backstop (30 s; took 30-34 s); its leader now looks at its record every
    ``hosted_beat_s`` (0.75 s here) and takes it back at once. The bound, four beat periods,
    leaves room for a loaded machine."""
    host, model = host
    old = host.wait("a leader", host.leader)
    key = keys.relay_leader(host.sender.epoch, HOST)
    host.ctl.set_text(key, "not json {")  # what the chaos run wrote
    garbled = time.monotonic()
    beat_s = timing(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, timeout_s=10).hosted_beat_s
    bound_s = 4 * beat_s
    first = host.wait("a readable leader record again", host.leader, timeout_s=bound_s + 40)
    took_s = time.monotonic() - garbled
    print(f"garbled leader record replaced after {took_s:.2f} s (bound {bound_s:.2f} s)")
    assert took_s <= bound_s, (took_s, host.logs())
    assert first.term > old.term, (old, first)  # the term goes on
    holders = leadership(host, 2 * HEARTBEAT_TIMEOUT_S)
    assert holders == [first.rid], (f"leadership changed {len(holders) - 1} times after the garble "
                                    f"(old leader rid={old.rid}): {holders[:40]}\n{host.logs()}")  # fmt: skip
    for version in (2, 3):
        host.push(model, version, NAMES)
    assert host.leader() == first or host.leader().rid == first.rid, host.logs()


def leadership(host: Host, seconds: float) -> list[int]:
    """The rids the host's leader record named over ``seconds`` (-1: none readable), in order, repeats dropped."""
    holders: list[int] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        record = host.leader()
        rid = -1 if record is None else record.rid
        if not holders or holders[-1] != rid:
            holders.append(rid)
        time.sleep(0.02)  # a sampling period, not a synchronisation
    return holders


@pytest.mark.parametrize("host", [["a", "b"]], indirect=True)
def test_two_leaders_stopped_in_turn_do_not_take_the_host_from_each_other_for_ever(host) -> None:
    """Issue 32 (the flip found by the chaos run with garbage): each of two host-mates took over
    once from the other, stopped, on its board's silence (a "suspect"). Old code kept that suspect
    after it led, and judged the next record with it: the leader that lost the host (rung by the
    taker) took it straight back from its live host-mate, which did the same, every 50-200 ms."""
    host, model = host
    for _ in range(2):  # each one stopped once while it leads: each takes over from the other once
        leader = host.wait("a leader", host.leader)
        os.kill(leader.pid, signal.SIGSTOP)
        try:
            host.wait("a host-mate to take over", lambda old=leader.rid: (r := host.leader()) is not None
                      and r.rid != old, timeout_s=4 * HEARTBEAT_TIMEOUT_S)  # fmt: skip
        finally:
            os.kill(leader.pid, signal.SIGCONT)
        host.wait("the stopped one to beat again", lambda: set(host.sender.receivers()) == {"a", "b"})
    holders = leadership(host, 2 * HEARTBEAT_TIMEOUT_S)
    assert len(holders) == 1, f"leadership changed {len(holders) - 1} times: {holders[:40]}\n{host.logs()}"
    for version in (2, 3):
        host.push(model, version, ["a", "b"])
