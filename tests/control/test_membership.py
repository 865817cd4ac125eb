"""Membership as the sender sees it, on a real in-memory store: registration, heartbeats, leaving, retiring."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_wsync._control import keys
from lightning_wsync._control.host import pid_namespace
from lightning_wsync._control.member_state import MemberState, Rejection, StateReport, decode_state
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import timing
from lightning_wsync._push import membership as _membership
from lightning_wsync._push.membership import Membership

HOST = "host-a"
HB_TIMEOUT_S = 0.2


def register(ctl: Control, name: str, *, host: str = HOST, pid: int | None = None, fleet: str | None = None) -> int:
    """What a WeightReceiver writes when it joins."""
    rid = ctl.add(keys.MEMBERS_NEXT, 1) - 1
    ctl.add(keys.member_heartbeat(rid), 1)
    record = {"name": name, "host": host, "pid": os.getpid() if pid is None else pid, "pidns": pid_namespace()}
    if fleet is not None:
        record["fleet"] = fleet
    ctl.set_json(keys.member(rid), record)
    return rid


def until(condition: Callable[[], bool], membership: Membership, timeout_s: float = 5.0) -> None:
    """Refresh until ``condition`` holds (a bounded poll, never a bare sleep)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        membership.refresh()
        time.sleep(0.01)


@pytest.fixture
def ctl() -> Control:
    return Control(dist.HashStore(), "m")


def test_registered_receivers_are_live_under_their_names(ctl):
    members = Membership(ctl, HOST, timing(heartbeat_timeout_s=HB_TIMEOUT_S, timeout_s=30.0))
    a, b = register(ctl, "a"), register(ctl, "b")
    members.refresh()
    assert [m.label for m in members.live()] == ["a", "b"] and (a, b) == (0, 1)
    assert members.failure(a) is None and members.failure(99) == "unknown receiver"


def test_fleet_seen_only_once_a_receiver_names_a_fleet_group(ctl):
    """What starts the sender's fleet coordinator: without fleet receivers it never runs."""
    members = Membership(ctl, HOST, timing(heartbeat_timeout_s=HB_TIMEOUT_S, timeout_s=30.0))
    register(ctl, "plain")
    members.refresh()
    assert [m.fleet for m in members.live()] == [None] and not members.fleet_seen
    register(ctl, "member", fleet="rollout")
    members.refresh()
    assert [m.fleet for m in members.live()] == [None, "rollout"] and members.fleet_seen


def test_a_silent_receiver_stops_being_live_and_comes_back_with_its_heartbeat(ctl):
    members = Membership(ctl, HOST, timing(heartbeat_timeout_s=HB_TIMEOUT_S, timeout_s=30.0))
    rid = register(ctl, "quiet")
    members.refresh()
    until(lambda: not members.live(), members)
    reason = members.failure(rid)
    assert reason is not None and reason.startswith("no heartbeat for ")
    assert reason.endswith(f"(heartbeat_timeout_s={HB_TIMEOUT_S})")
    ctl.add(keys.member_heartbeat(rid), 1)
    members.refresh()
    assert [m.label for m in members.live()] == ["quiet"]


def test_a_closed_receiver_is_gone_then_retired_and_its_keys_deleted(ctl):
    members = Membership(ctl, HOST, timing(heartbeat_timeout_s=HB_TIMEOUT_S, timeout_s=30.0))
    first, second = register(ctl, "first"), register(ctl, "second")
    members.refresh()
    ctl.set_json(keys.member_gone(first), True)
    ctl.bump(keys.MEMBERS_GONE)  # as WeightReceiver.close() does
    members.refresh()
    assert members.failure(first) == "closed" and [m.label for m in members.live()] == ["second"]
    until(lambda: members.get(first) is not None and members.get(first).retired, members)
    assert not any(ctl.has(key) for key in keys.member_keys(first))
    assert ctl.get_json(keys.MEMBERS_LOW) == second  # a later sender starts looking at "second"
    assert members.failure(first) == "closed"  # reports still say why
    later = Membership(ctl, HOST, timing(heartbeat_timeout_s=HB_TIMEOUT_S, timeout_s=30.0))
    later.refresh()
    assert [m.label for m in later.members()] == ["second"]


def test_a_receiver_whose_process_exited_is_gone_at_once_on_its_host(ctl):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    members = Membership(ctl, HOST, timing(heartbeat_timeout_s=60.0, timeout_s=30.0))
    here = register(ctl, "here", pid=proc.pid)
    elsewhere = register(ctl, "elsewhere", host="host-b", pid=proc.pid)  # pids of other hosts mean nothing here
    members.refresh()
    assert members.failure(here) == f"process {proc.pid} exited"
    assert members.failure(elsewhere) is None


def test_an_exited_process_is_gone_between_full_reads_of_the_members(ctl):
    """The sender reads every member's heartbeat once a second (refresh(members=True)) but
    checks at every call, without a request, whether a same-host receiver's process exited:
    a link to a receiver killed mid-send is stopped (its ring slots freed) at once."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    members = Membership(ctl, HOST, timing(heartbeat_timeout_s=60.0, timeout_s=30.0))
    here = register(ctl, "here", pid=proc.pid)
    members.refresh()
    assert [m.rid for m in members.live()] == [here]
    proc.communicate(timeout=30)  # it exits once its stdin closes
    members.refresh(members=False)
    assert members.failure(here) == f"process {proc.pid} exited"
    gone, retired = members.take_changes()
    assert [p.rid for p in gone] == [here] and retired == []


def test_an_id_reserved_without_a_record_does_not_hide_later_receivers(ctl):
    members = Membership(ctl, HOST, timing(heartbeat_timeout_s=HB_TIMEOUT_S, timeout_s=30.0))
    dead = ctl.add(keys.MEMBERS_NEXT, 1) - 1  # died between taking its id and writing its record
    register(ctl, "late")
    members.refresh()
    assert [m.label for m in members.live()] == ["late"]
    until(lambda: ctl.get_json(keys.MEMBERS_LOW) == dead + 1, members)  # given up: no heartbeat key
    assert members.get(dead) is None


def test_state_reports_round_trip_and_retired_receivers_read_as_holding_nothing(ctl):
    members = Membership(ctl, HOST, timing(heartbeat_timeout_s=HB_TIMEOUT_S, timeout_s=30.0))
    rid = register(ctl, "r")
    members.refresh()
    report = StateReport(rid)
    report.held(4)
    report.held(3)  # older news never lowers what is held
    report.rejected(5, "checksum mismatch in bucket 0")
    report.write(ctl)
    (raw,) = members.read_states(ctl, [rid])
    assert decode_state(ctl, rid, raw) == MemberState(acked=4, rejected=Rejection(5, "checksum mismatch in bucket 0"))
    ctl.set_json(keys.member_gone(rid), True)
    ctl.bump(keys.MEMBERS_GONE)  # as WeightReceiver.close() does
    until(lambda: members.get(rid).retired, members)
    (raw,) = members.read_states(ctl, [rid])
    assert decode_state(ctl, rid, raw) == MemberState(acked=-1, rejected=None)


def test_a_receiver_retired_and_forgotten_still_reads_as_holding_nothing(monkeypatch):
    """A push report can outlive its targets' records: one retired and then forgotten
    (``_FORGET_AFTER`` heartbeat timeouts later) has no keys left; reading its state must not
    wait out the store's timeout (seen in test_link_churn: WeightSyncStoreError from wait())."""
    monkeypatch.setattr(_membership, "_FORGET_AFTER", 1)
    ctl = Control(dist.HashStore(), "m")
    ctl.store.set_timeout(timedelta(seconds=30))  # a read of a missing key would wait this long
    members = Membership(ctl, HOST, timing(heartbeat_timeout_s=HB_TIMEOUT_S, timeout_s=30.0))
    rid = register(ctl, "r")
    members.refresh()
    ctl.set_json(keys.member_gone(rid), True)
    ctl.bump(keys.MEMBERS_GONE)  # as WeightReceiver.close() does
    until(lambda: members.get(rid) is None, members)
    started = time.monotonic()
    (raw,) = members.read_states(ctl, [rid])
    assert decode_state(ctl, rid, raw) == MemberState(acked=-1, rejected=None)
    assert time.monotonic() - started < 5.0


def test_a_live_receiver_whose_state_key_went_reads_as_holding_nothing_at_once():
    """A receiver whose keys went between the sender's refresh and a push report's read (deleted
    as an id that never registered, under load) must not hold the report for the store's
    timeout (seen in ci-fresh's test_link_churn: WeightSyncStoreError from wait()); the others'
    states read as written."""
    ctl = Control(dist.HashStore(), "m")
    ctl.store.set_timeout(timedelta(seconds=30))  # a read of a missing key would wait this long
    members = Membership(ctl, HOST, timing(heartbeat_timeout_s=HB_TIMEOUT_S, timeout_s=30.0))
    kept, lost = register(ctl, "kept"), register(ctl, "lost")
    members.refresh()
    for rid in (kept, lost):
        report = StateReport(rid)
        report.held(7)
        report.write(ctl)
    ctl.delete(keys.member_state(lost))
    started = time.monotonic()
    raws = members.read_states(ctl, [kept, lost])
    assert time.monotonic() - started < 5.0
    assert [decode_state(ctl, rid, raw).acked for rid, raw in zip((kept, lost), raws)] == [7, -1]
