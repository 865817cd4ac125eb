"""A relay host's leader asks the store about one request a second at idle (issue 22), and still
learns of a sender's close and of a new sender at once.

The leader reads the store's ``news`` when woken (by each version it relays, and by its bell,
which the sender rings at a new chain, at its close, and when a new sender starts), not every
second, and waits for the next leader's ``ready`` notes (one blocking wait each), not polling
them. Each simulated host (``WSYNC_HOST_ID``) is one receiver process behind a counting proxy
of its own (:mod:`lightning_wsync.testing.storeproxy`). Before: 1.2 ``news`` reads a second and
a ``ready`` look every 5 s at idle (~2.3 requests/s per leader, heartbeats included).
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest
from _lead_quiet import receiver_main, sender_main
from test_relay_store_load import _keys, _wait  # (the counts by key, a bounded wait)

from lightning_wsync import WeightSender
from lightning_wsync._control.store import Control
from lightning_wsync._planes.relay.head.feed import leader_record
from lightning_wsync._planes.relay.hops import read_chain
from lightning_wsync.testing.models import build_model, digest, mutate, spec_for_size
from lightning_wsync.testing.procs import receive
from lightning_wsync.testing.storeproxy import CountingProxy
from lightning_wsync.testing.stores import host_store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

IDLE_S = 20.0  # shorter than the 30 s backstops: each lands in it at most once
HEARTBEAT_TIMEOUT_S = 16.0  # relay receivers beat every quarter of it: 4 s
PROMPT_S = 3.0  # a close or a new sender reaches every receiver of a relay host within this
# What a leader may read at idle: its heartbeat and acknowledgement, its watcher's backstop (news,
# the sender pointer, the close, latest), its bell's backstop ring (the bell, the chain, its record),
# and the last version's notes on the hops (a note that goes by as the window opens).
_IDLE_KEYS = {"member/#/hb", "member/#/state", "news", "sender/current", "closed/#", "latest",
              "relay/#/bell/#", "relay/#/chain", "relay/#/leader/*", "relay/#/pg/#/#/ready/#",
              "member/#"}  # fmt: skip
# ``member/#``: a leader's own receiver beats through its leader's notes like any host-mate, and the
# leader reads the signed member record of a note's writer when its notes appear (two reads). They
# come before the window in a run here; in CI at -n 2 they once fell inside it.
_MEMBER_READS = 2


def _control(port: int, job: str) -> Control:
    """The job's keys on a store hosted here (the sender and the receivers are its clients)."""
    server = host_store("127.0.0.1", port, timeout_s=30, multi_tenant=True)
    return Control(server, job)


def _sender(model, port: int, job: str, monkeypatch) -> WeightSender:  # type: ignore[no-untyped-def]
    with monkeypatch.context() as env:
        env.setenv("WSYNC_HOST_ID", "trainer-host")
        return WeightSender(model, store=f"127.0.0.1:{port}", job=job, timeout_s=20, cross_host="relay",
                            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)  # fmt: skip


def _apply(conns, version: int, want: str) -> list[float]:  # type: ignore[no-untyped-def]
    """Have each receiver wait for ``version``; when each applied it (wall clock), bit-exact."""
    for conn in conns:
        conn.send(("await", version))
    out = []
    for conn in conns:
        got = receive(conn, 60, f"version {version} applied")
        assert got[0] == "applied" and got[1] == version and got[2] == want, got
        out.append(float(got[3]))  # type: ignore[arg-type]
    return out


def test_a_relay_leader_asks_about_one_request_a_second_at_idle(children, monkeypatch, port) -> None:
    spec = spec_for_size(1)
    model = build_model(spec, seed=0)
    job = f"quiet-{port}"
    ctl = _control(port, job)
    with CountingProxy("127.0.0.1", port) as proxy_a, CountingProxy("127.0.0.1", port) as proxy_b:
        with _sender(model, port, job, monkeypatch) as sender:
            mutate(model, 1)
            sender.push(1)
            a = children.start(receiver_main, (proxy_a.address, job, "qa", "simhost-qa", spec), name="wsync-test-qa")
            rid_a = receive(a, 60, "host a's receiver")[1]
            _wait("host a's leader", lambda: leader_record(ctl, sender.epoch, "simhost-qa"))
            b = children.start(receiver_main, (proxy_b.address, job, "qb", "simhost-qb", spec), name="wsync-test-qb")
            rid_b = receive(b, 60, "host b's receiver")[1]
            _wait("the chain a -> b", lambda: (c := read_chain(ctl, sender.epoch)) is not None
                  and c.rids == (rid_a, rid_b))  # fmt: skip
            _apply((a, b), 1, digest(model))
            mutate(model, 2)
            sender.push(2)  # down the chain: a's hop to b now waits for b's note for the next version
            _apply((a, b), 2, digest(model))
            before_a, before_b = proxy_a.snapshot_keys(), proxy_b.snapshot_keys()
            time.sleep(IDLE_S)  # the measuring window itself
            idle_a, idle_b = proxy_a.snapshot_keys() - before_a, proxy_b.snapshot_keys() - before_b
            for conn in (a, b):
                conn.send(("await", 3))  # none comes: they see the close instead
        for conn in (a, b):
            assert receive(conn, 30, "the close")[0] == "closed"
    assert proxy_a.unparsed == 0 and proxy_b.unparsed == 0
    beats = IDLE_S / (HEARTBEAT_TIMEOUT_S / 4) + 1
    for counts in (idle_a, idle_b):
        idle = _keys(counts)
        # By key: no polls of news (before: 1.2 a second), only the heartbeat and the backstops:
        # the bell's ring (the bell's set, wait and delete, the chain, the leader record, and the
        # news read it wakes: 6) and the watcher's (news, the sender pointer, the close, latest's
        # wait and get: 5), each at most once here, and a note going by (5). Typically the beats
        # alone; at its periods a leader asks ~0.9 requests/s (before: ~30 in this window).
        assert set(idle) <= _IDLE_KEYS, (idle, dict(counts))
        assert idle.get("member/#/hb", 0) <= beats, idle
        assert idle.get("news", 0) <= 3, idle
        assert idle.get("member/#", 0) <= _MEMBER_READS, idle
        assert sum(idle.values()) <= beats + 6 + 5 + 5 + _MEMBER_READS, idle
        # The `ready` notes are waited for, never looked at (before: a `check` every 5 s on host
        # a); at most one goes by as the window opens (its set, wait, get and delete, the next wait).
        notes: Counter[str] = Counter()
        for key, n in counts.items():
            if "/ready/" in key:
                notes[key.split(" ", 1)[0]] += n  # by command
        assert notes["check"] == 0 and notes.total() <= 5, notes


def test_a_relay_host_sees_a_new_sender_and_a_close_at_once(children, monkeypatch, port) -> None:
    spec = spec_for_size(1)
    model = build_model(spec, seed=0)
    job = f"prompt-{port}"
    host = "simhost-qs"
    ctl = _control(port, job)
    first = children.start(sender_main, (f"127.0.0.1:{port}", job, spec, HEARTBEAT_TIMEOUT_S), name="wsync-test-s1")
    _, pid, epoch, want = receive(first, 60, "the first sender's version 1")
    lead = children.start(receiver_main, (f"127.0.0.1:{port}", job, "lead", host, spec), name="wsync-test-lead")
    rid = receive(lead, 60, "the leader")[1]
    _wait("the leader to lead", lambda: (r := leader_record(ctl, epoch, host)) is not None  # type: ignore[arg-type]
          and r.rid == rid)  # fmt: skip
    mate = children.start(receiver_main, (f"127.0.0.1:{port}", job, "mate", host, spec), name="wsync-test-mate")
    receive(mate, 60, "the host-mate")
    _apply((lead, mate), 1, want)  # type: ignore[arg-type]
    os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]  # no close record: only news tells of the next sender
    with _sender(model, port, job, monkeypatch) as second:
        mutate(model, 2)
        pushed = time.time()
        handle = second.push(2)
        applied = _apply((lead, mate), 2, digest(model))
        # Before this change's rings, the leader found the new sender at its bell's 30 s backstop.
        assert max(applied) - pushed < PROMPT_S, [t - pushed for t in applied]
        for conn in (lead, mate):
            conn.send(("await", 3))
        # close() first waits for the last push's report: waited here, so that the bound below is
        # the close's way to the host alone. (A run in CI on 2026-11-29 saw the close 5.1 s late,
        # not reproduced since: that wait in it, or the relay head ringing the leaders' bells only
        # after joining its feed thread, which may sit in a hop for seconds; it now rings first.)
        handle.wait(30)
        closing = time.time()
    seen = [float(receive(conn, 30, "the close")[1]) for conn in (lead, mate)]  # type: ignore[arg-type]
    assert max(seen) - closing < PROMPT_S, [t - closing for t in seen]
