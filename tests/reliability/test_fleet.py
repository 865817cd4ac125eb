"""One version across a fleet (``ReceiverConfig.fleet``, issue 24): receivers in separate
processes apply only versions every member staged; a stalled member is left out and
rejoins, and the trainer's ``push()`` never waits for it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection

import pytest
from _fleet_workers import fleet_member_main
from _spawn import CTX
from _workers import digest, mixed_model, mutate

from lightning_wsync import WeightSender
from lightning_wsync.testing.procs import Children, receive

GROUP = "rollout"
PUSH_EVERY_S = 0.004


class Pusher:
    """Pushes a new version every few ms from a thread; keeps each version's digest and push()'s stalls."""

    def __init__(self, sender: WeightSender, model: object) -> None:
        self.sender, self.model = sender, model
        self.digests: dict[int, str] = {}
        self.stalls: list[float] = []
        self.handles: list[object] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-pusher", daemon=True)

    def _run(self) -> None:
        version = 0
        while not self._stop.is_set():
            version += 1
            mutate(self.model, version)
            self.digests[version] = digest(self.model)
            started = time.perf_counter()
            self.handles.append(self.sender.push(version))
            self.stalls.append(time.perf_counter() - started)
            self._stop.wait(PUSH_EVERY_S)

    def __enter__(self) -> Pusher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@contextmanager
def fleet(
    port: int, job: str, timeout_s: float
) -> Iterator[tuple[WeightSender, object, dict[str, Connection], dict[str, int], Children]]:
    store = f"127.0.0.1:{port}"
    model = mixed_model(1)
    started = Children(join_timeout_s=5, context=CTX)
    with WeightSender(model, store=store, job=job, timeout_s=timeout_s) as sender, started as kids:
        conns = {n: kids.start(fleet_member_main, (store, job, n, {"fleet": GROUP, "timeout_s": 30}), n) for n in "ab"}
        rids = {n: receive(c, 60, f"{n} ready")[1] for n, c in conns.items()}
        deadline = time.monotonic() + 30
        while set(sender.receivers()) != {"a", "b"}:
            assert time.monotonic() < deadline, f"members not seen by the sender: {sender.receivers()}"
            time.sleep(0.01)
        yield sender, model, conns, rids, kids  # type: ignore[misc]
        for c in conns.values():
            c.send("stop")


def observe(conns: dict[str, Connection], names: str) -> dict[str, tuple[int | None, str]]:
    for n in names:
        conns[n].send("update")
    return {n: tuple(receive(conns[n], 30, f"{n} update")[1:]) for n in names}  # type: ignore[misc]


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_members_hold_the_same_version_at_every_observation(port):
    with fleet(port, "fleet-same", timeout_s=10) as (sender, model, conns, rids, _):
        with Pusher(sender, model) as pusher:
            observations, raced, differ = [], 0, []
            deadline = time.monotonic() + 60
            while (len(observations) < 40 or len({v for v, _ in observations}) < 10) and time.monotonic() < deadline:
                before = (sender.fleet_switches(GROUP) or [None])[-1]
                seen = observe(conns, "ab")
                after = (sender.fleet_switches(GROUP) or [None])[-1]
                if before is None or before != after or not {rids["a"], rids["b"]} <= set(before.rids):
                    raced += 1  # the fleet switched between the two updates: not one moment
                    continue
                observations.append((before.version, seen))
                if {v for v, _ in seen.values()} != {before.version}:
                    differ.append((before.version, seen))
        assert not differ, f"members on different versions at one fleet switch: {differ[:5]}"
        assert len(observations) >= 40, f"only {len(observations)} observations ({raced} raced a switch)"
        for version, seen in observations:
            assert seen["a"][1] == seen["b"][1] == pusher.digests[version], f"version {version}: bytes differ"
        versions = sorted({v for v, _ in observations})
        assert len(versions) >= 10, f"the fleet hardly moved: {versions}"
        assert max(pusher.stalls) < 0.5, f"push() stalled {max(pusher.stalls):.3f} s"


def until(what: str, conns: dict[str, Connection], names: str, cond: object, timeout_s: float = 60.0) -> None:
    """Keep the members ``names`` calling update() (as a rollout loop would) until ``cond()``."""
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        observe(conns, names)


@pytest.mark.timeout(150)
@pytest.mark.slow
def test_a_stalled_member_is_left_out_and_rejoins(port):
    timeout_s = 1.5
    with fleet(port, "fleet-stall", timeout_s=timeout_s) as (sender, model, conns, rids, kids):
        b_pid = kids.pids[1]
        both = {rids["a"], rids["b"]}
        switches = lambda: sender.fleet_switches(GROUP)  # noqa: E731
        with Pusher(sender, model) as pusher:
            until("a switch with both", conns, "ab", lambda: any(both <= set(s.rids) for s in switches()))
            pushes_at_stop = len(pusher.stalls)
            os.kill(b_pid, signal.SIGSTOP)
            try:
                until(
                    "b left out", conns, "a", lambda: any("b" in s.excluded and rids["a"] in s.rids for s in switches())
                )
                left_out = next(s for s in switches() if "b" in s.excluded)
                reason = left_out.excluded["b"]
                assert f"within timeout_s={timeout_s}" in reason or "not caught up" in reason, reason
                # a moves on without b
                until("a moving on", conns, "a", lambda: switches()[-1].version > left_out.version + 20)
                a_now = observe(conns, "a")["a"]
                assert a_now[0] is not None and a_now[0] > left_out.version
                assert a_now[1] == pusher.digests[a_now[0]]
                stalls = pusher.stalls[pushes_at_stop:]
                assert len(stalls) > 50, f"only {len(stalls)} pushes while b was stopped"
                assert max(stalls) < 0.25, f"push() waited on the stalled member: {max(stalls):.3f} s"
            finally:
                os.kill(b_pid, signal.SIGCONT)
            until("b back in a switch", conns, "ab", lambda: any(
                rids["b"] in s.rids and s.version > a_now[0] for s in switches()))  # fmt: skip
            for _ in range(50):  # and at one moment both hold the switched version again
                sw = switches()[-1]
                seen = observe(conns, "ab")
                if switches()[-1] == sw and both <= set(sw.rids):
                    assert seen["a"] == seen["b"] == (sw.version, pusher.digests[sw.version])
                    break
            else:
                pytest.fail("no observation with both members in the newest switch")
        # the push reports name who was left out
        reports = [h.wait(0.1) for h in pusher.handles[pushes_at_stop : pushes_at_stop + 200] if not h.dropped]
        assert any("b" in r.fleet[GROUP].excluded for r in reports if GROUP in r.fleet), "no report names b"


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_member_joining_later_never_holds_the_fleet_up(port):
    timeout_s = 20.0  # a round waiting on the newcomer would show as a gap this long
    with fleet(port, "fleet-join", timeout_s=timeout_s) as (sender, model, conns, rids, kids):
        both = {rids["a"], rids["b"]}
        switches = lambda: sender.fleet_switches(GROUP)  # noqa: E731
        with Pusher(sender, model) as pusher:
            until("a switch with both", conns, "ab", lambda: any(both <= set(s.rids) for s in switches()))
            store = f"127.0.0.1:{port}"
            conns["c"] = kids.start(
                fleet_member_main, (store, "fleet-join", "c", {"fleet": GROUP, "timeout_s": 30}), "c"
            )
            started = time.monotonic()
            rids["c"] = receive(conns["c"], 60, "c ready")[1]
            ready = time.monotonic()
            until("a switch with all three", conns, "abc", lambda: rids["c"] in switches()[-1].rids)
            # Timed from the newcomer's registration, not from its process start: the one failure
            # (20 s, and 11.1 s in a loop at load 18) was timed from before the spawn, which on a
            # loaded 2-core machine is mostly importing torch (issue 32, docs/reliability.md).
            joined = time.monotonic()
            print(f"newcomer: start to ready {ready - started:.2f} s, ready to a switch with it {joined - ready:.2f} s")
            assert joined - ready < timeout_s / 2, "the newcomer held a round up"
            for _ in range(50):
                sw = switches()[-1]
                seen = observe(conns, "abc")
                if switches()[-1] == sw and set(rids.values()) <= set(sw.rids):
                    assert seen["a"] == seen["b"] == seen["c"] == (sw.version, pusher.digests[sw.version])
                    break
            else:
                pytest.fail("no observation with all three members in the newest switch")
        reasons = {s.excluded["c"] for s in switches() if "c" in s.excluded}
        assert all(r.startswith("joining") for r in reasons), reasons


@pytest.mark.timeout(60)
def test_verifying_members_stage_checked_versions(port):
    """With ``verify=True`` a member checks the round's target against the checksums carried
    in the round record (the version's own sums key is deleted a few pushes later)."""
    from lightning_wsync import WeightReceiver

    store, job = f"127.0.0.1:{port}", "fleet-verify"
    model = mixed_model(1)
    mods = {n: mixed_model(5) for n in "ab"}
    digests: dict[int, str] = {}
    with (
        WeightSender(model, store=store, job=job, timeout_s=10) as sender,
        WeightReceiver(mods["a"], store=store, job=job, name="a", fleet=GROUP, verify=True) as a,
        WeightReceiver(mods["b"], store=store, job=job, name="b", fleet=GROUP, verify=True) as b,
    ):
        deadline = time.monotonic() + 30
        for version in range(1, 10**6):
            mutate(model, version)
            digests[version] = digest(model)
            sender.push(version)
            a.update(), b.update()
            switches = sender.fleet_switches(GROUP)
            if len({s.version for s in switches if {a.rid, b.rid} <= set(s.rids)}) >= 5:
                break
            assert time.monotonic() < deadline, f"the fleet did not move: {switches}"
            time.sleep(PUSH_EVERY_S)  # the trainer's pace, not a synchronisation
        while True:  # pushes have stopped: the fleet settles on one last switch
            a.update(), b.update()
            final = sender.fleet_switches(GROUP)[-1]
            if a.version == b.version == final.version and {a.rid, b.rid} <= set(final.rids):
                break
            assert time.monotonic() < deadline, (a.version, b.version, final)
        assert digest(mods["a"]) == digest(mods["b"]) == digests[final.version]
        assert a.rejected == b.rejected == 0


@pytest.mark.timeout(60)
def test_the_coordinator_runs_only_once_a_receiver_names_a_fleet_group(port):
    """A sender whose receivers use no fleet runs no coordinator thread; the first fleet
    member starts it, and its rounds then switch versions as usual."""
    from lightning_wsync import WeightReceiver

    store, job = f"127.0.0.1:{port}", "fleet-lazy"
    model = mixed_model(1)
    coordinators = lambda: [t for t in threading.enumerate() if t.name == "wsync-fleet"]  # noqa: E731
    with (
        WeightSender(model, store=store, job=job, timeout_s=10) as sender,
        WeightReceiver(mixed_model(5), store=store, job=job, name="plain") as plain,
    ):
        mutate(model, 1)
        handle = sender.push(1)
        assert plain.wait_for_version(1, timeout_s=30) == 1
        assert sorted(handle.wait(timeout_s=30).delivered) == ["plain"]  # so the sender has seen it
        assert coordinators() == []
        with WeightReceiver(mixed_model(5), store=store, job=job, name="a", fleet=GROUP) as a:
            deadline = time.monotonic() + 30
            version = 1
            while a.version is None or a.version < 2:  # only a fleet switch lets a apply anything
                assert time.monotonic() < deadline, f"no fleet switch: {sender.fleet_switches(GROUP)}"
                version += 1
                mutate(model, version)
                sender.push(version)
                a.update()
                time.sleep(PUSH_EVERY_S)  # the trainer's pace, not a synchronisation
            assert len(coordinators()) == 1
            switched = sender.fleet_switches(GROUP)
            assert a.rid in switched[-1].rids and a.version in {s.version for s in switched}
    assert coordinators() == []
