"""How a push report counts its receivers when the sender's view of their heartbeats is stale
(issue 32: "8 of 16 receivers reported the versions" in a 16-host bench run).

A report's targets are the members the sender's ``Membership`` holds live when the version is
pushed and published. That view is what the sender last read: ``hb_seen_at`` moves only at a
full refresh (every ``timing.member_check_s`` on the sender's background thread, which a busy
or starved process can leave older than ``heartbeat_timeout_s``). Before, a report then named
8 of 16 receivers while all 16 held the version: the 8 the stale view called silent were left
out, or failed at once with "no heartbeat". Now a report reads those receivers' heartbeats
again before it leaves one out or fails it (``Membership.recheck_silent``).
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from lightning_wsync._control import keys
from lightning_wsync._control.host import pid_namespace
from lightning_wsync._control.member_state import StateReport, decode_state
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import timing
from lightning_wsync._push.membership import Membership
from lightning_wsync._push.report import PushHandle, Reporter

HB_TIMEOUT_S = 4.0  # the stale window is half of it: a stall of this process that long would void the test
N = 16
VERSION = 3


def register(ctl: Control, name: str, host: str) -> int:
    """What a WeightReceiver writes when it joins (as tests/control/test_membership.py)."""
    rid = ctl.add(keys.MEMBERS_NEXT, 1) - 1
    ctl.add(keys.member_heartbeat(rid), 1)
    ctl.set_json(keys.member(rid), {"name": name, "host": host, "pid": os.getpid(), "pidns": pid_namespace()})
    return rid


def _setup() -> tuple[Control, Membership, Reporter, list[int], list[int]]:
    ctl = Control(dist.HashStore(), "m")
    members = Membership(ctl, "trainer", timing(heartbeat_timeout_s=HB_TIMEOUT_S, timeout_s=30.0))
    rids = [register(ctl, f"h{h}r0", host=f"h{h}") for h in range(1, N + 1)]
    members.refresh()
    seen = time.monotonic()
    beat_late, beat_early = rids[: N // 2], rids[N // 2 :]
    _after(seen + HB_TIMEOUT_S / 2)
    # Every receiver beats again; the sender's next full read comes when half of the beats have landed,
    for rid in beat_early:
        ctl.add(keys.member_heartbeat(rid), 1)
    members.refresh()
    for rid in beat_late:
        ctl.add(keys.member_heartbeat(rid), 1)
    # and then its thread reads no heartbeat for heartbeat_timeout_s (busy or starved): its view moves
    # with time alone.
    _after(seen + HB_TIMEOUT_S * 1.05)
    assert all(members.failure(rid) is not None for rid in beat_late)
    assert all(members.failure(rid) is None for rid in beat_early), "this process stalled for HB_TIMEOUT_S / 2"
    reporter = Reporter(ctl, members, lambda: [], None, total_bytes=1, timeout_s=5.0)
    return ctl, members, reporter, beat_late, beat_early


def _after(when: float) -> None:
    """Let the clock pass ``when`` (what is tested is the passing of time)."""
    while time.monotonic() < when:
        time.sleep(0.01)


def _acknowledge(ctl: Control, rids: list[int], version: int = VERSION) -> None:
    for rid in rids:
        report = StateReport(rid)
        report.held(version)
        report.write(ctl)


def test_receivers_a_stale_view_calls_silent_at_the_push_are_counted_when_they_beat():
    """Pushed and published while the sender's view is stale: all 16 delivered, none failed
    (before: 8 targets, 8 delivered)."""
    ctl, members, reporter, beat_late, beat_early = _setup()
    members.refresh(members=False)  # what push() and publication do: no heartbeat read
    handle = PushHandle(reporter, VERSION, time.perf_counter(), 0.0, targets=members.live())
    handle.published(members.live())
    _acknowledge(ctl, [*beat_late, *beat_early])  # all 16 hold the version
    report = handle.wait(timeout_s=5.0)
    assert sorted(report.delivered) == sorted(f"h{r + 1}r0" for r in [*beat_late, *beat_early])
    assert len(report.delivered) == N and report.failed == {}
    states = members.read_states(ctl, [*beat_late, *beat_early])
    assert [decode_state(ctl, rid, raw).acked for rid, raw in zip([*beat_late, *beat_early], states)] == [VERSION] * N
    assert len(members.live()) == N  # the report's read of their beats made them live again


def test_targets_a_stale_view_calls_silent_are_not_failed_while_they_beat(monkeypatch):
    """Targets at the push that the stale view calls silent and that acknowledge right after the
    report's first poll read their states: delivered (before: failed at that poll with 'no
    heartbeat'). A target that really stopped beating is still failed at once, with the reason."""
    ctl, members, reporter, beat_late, beat_early = _setup()
    every = sorted(members.members(), key=lambda m: m.rid)
    handle = PushHandle(reporter, VERSION, time.perf_counter(), 0.0, targets=every)  # live when pushed
    handle.published([])
    _acknowledge(ctl, beat_early)
    read_states, polls = members.read_states, []

    def poll_then_acknowledge_late(ctl_: Control, rids: list[int]) -> list[bytes]:
        states = read_states(ctl_, rids)
        polls.append(sorted(rids))
        if len(polls) == 1:  # the late ones acknowledge once the report's first poll has read them
            _acknowledge(ctl, beat_late)
        return states

    monkeypatch.setattr(members, "read_states", poll_then_acknowledge_late)
    report = handle.wait(timeout_s=5.0)
    assert sorted(report.delivered) == sorted(m.label for m in every) and report.failed == {}, report.failed
    assert polls[0] == sorted(m.rid for m in every) and len(polls) >= 2

    stopped = beat_late[0]  # no beat from here on: the store agrees with the view
    _after(time.monotonic() + HB_TIMEOUT_S * 1.05)
    beating = [m.rid for m in every if m.rid != stopped]
    for rid in beating:
        ctl.add(keys.member_heartbeat(rid), 1)
    handle = PushHandle(reporter, VERSION + 1, time.perf_counter(), 0.0, targets=every)
    handle.published([])
    _acknowledge(ctl, beating, VERSION + 1)
    report = handle.wait(timeout_s=5.0)
    assert len(report.delivered) == N - 1
    name = f"h{stopped + 1}r0"
    assert report.failed.keys() == {name}, report.failed
    assert report.failed[name].startswith("no heartbeat for "), report.failed
