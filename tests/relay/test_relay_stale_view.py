"""The relay head re-forms its chain or trees only for a leader the store calls silent, not for one
whose beat the sender's view has merely not read yet (issue 32: the 16-host bench sent 1.57 models
per push; each re-form mid-version sends the newest version again, in full).

The head takes its leaders from the sender's live list at each membership refresh
(``WeightSender._refresh`` -> ``RelaySendPlane.sync``). Heartbeats are read from the store every
``member_check_s``; between those reads the view ages with the clock, and a busy or starved
sender thread can leave it older than ``heartbeat_timeout_s`` while the leaders beat on. Before,
such a leader left the chain and came back at the next read: two re-forms. Now the refresh reads
the heartbeat of a member its view newly calls silent before the planes see the list
(``Membership._recheck_newly_silent``).

The sender's background thread is stopped here and its refresh driven by the test (the thread's
timing is what is being replaced by a chosen one); the leaders are registered by hand, as
receivers on hosts h1-h3 that lead them.
"""

from __future__ import annotations

import os
import time

import pytest
import torch.nn as nn

from lightning_wsync import WeightSender
from lightning_wsync._control import keys
from lightning_wsync._control.host import pid_namespace
from lightning_wsync._control.records import LeaderRecord
from lightning_wsync._control.store import Control
from lightning_wsync._planes.relay.hops import read_chain

pytestmark = pytest.mark.timeout(120)

HB_TIMEOUT_S = 4.0  # member_check_s = 1 s; the stale window is the last 0.2 x of it
HOSTS = ("h1", "h2", "h3")


def _after(when: float) -> None:
    """Let the clock pass ``when`` (what is tested is the passing of time)."""
    while time.monotonic() < when:
        time.sleep(0.01)


def _leaders(ctl: Control, epoch: int) -> dict[str, int]:
    """Register one receiver on each host of HOSTS and make it the host's relay leader."""
    rids = {}
    for term, host in enumerate(HOSTS, start=1):
        rid = ctl.add(keys.MEMBERS_NEXT, 1) - 1
        ctl.add(keys.member_heartbeat(rid), 1)
        record = {"name": f"{host}r0", "host": host, "pid": os.getpid(), "pidns": pid_namespace()}
        ctl.set_json(keys.member(rid), record)
        ctl.put(keys.relay_leader(epoch, host), LeaderRecord(rid, os.getpid(), term, f"wsync-1-{rid}-x", ready=True))
        rids[host] = rid
    return rids


def _refresh(sender: WeightSender, *, full: bool) -> None:
    """One refresh of the sender's background thread, a full read of the heartbeats or not."""
    sender._members_checked_at = 0.0 if full else time.monotonic()
    sender._refresh()


def _stop_background(sender: WeightSender) -> None:
    sender._stop.set()
    with sender._wake:
        sender._wake.notify()
    sender._thread.join(timeout=10)
    assert not sender._thread.is_alive()


def test_a_leader_whose_beat_the_view_has_not_read_yet_never_reforms_the_trees(server, port, monkeypatch):
    monkeypatch.setenv("WSYNC_HOST_ID", "trainer")
    model = nn.Linear(8, 8)
    with WeightSender(model, store=f"127.0.0.1:{port}", job="stale", timeout_s=30.0, heartbeat_timeout_s=HB_TIMEOUT_S,
                      cross_host="tree") as sender:  # fmt: skip
        _stop_background(sender)
        ctl = Control(server, "stale")
        rids = _leaders(ctl, sender.epoch)
        _refresh(sender, full=True)
        seen = time.monotonic()  # every beat is read by now
        first = read_chain(ctl, sender.epoch)
        assert first is not None and sorted(first.rids) == sorted(rids.values()) and first.tree

        # h1's and h2's next beats land before the sender's next full read, h3's right after it;
        # then the sender's thread reads no heartbeat until its view calls h3 silent.
        _after(seen + HB_TIMEOUT_S * 0.8)
        for host in ("h1", "h2"):
            ctl.add(keys.member_heartbeat(rids[host]), 1)
        _refresh(sender, full=True)
        ctl.add(keys.member_heartbeat(rids["h3"]), 1)
        _after(seen + HB_TIMEOUT_S * 1.05)
        assert sender._members.is_silent(rids["h3"]), "the view is not stale: this process stalled"
        _refresh(sender, full=False)  # what the thread does between full reads
        assert read_chain(ctl, sender.epoch) == first  # before: trees 2 without h3 (and 3 with it again)
        assert not sender._members.is_silent(rids["h3"])

        # A leader that really stopped beating still leaves, at the first refresh past its silence
        # (as before); the others beat on, their beats read only by the re-check.
        stopped = rids["h2"]
        for rid in rids.values():
            ctl.add(keys.member_heartbeat(rid), 1)
        before = time.monotonic()
        _refresh(sender, full=True)  # h2's last beat is read here
        last_read = time.monotonic()
        while True:
            started = time.monotonic()
            for host in ("h1", "h3"):
                ctl.add(keys.member_heartbeat(rids[host]), 1)
            _refresh(sender, full=False)
            chain = read_chain(ctl, sender.epoch)
            assert chain is not None
            if stopped not in chain.rids:
                break
            assert started <= last_read + HB_TIMEOUT_S, "a refresh past the stopped leader's silence kept it"
            time.sleep(0.05)
        assert time.monotonic() > before + HB_TIMEOUT_S  # not dropped before its silence
        assert sorted(chain.rids) == sorted([rids["h1"], rids["h3"]]) and chain.number == first.number + 1
