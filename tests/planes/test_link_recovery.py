"""Network links recover: a link the sender dropped is rebuilt, and a receiver paused past
every timeout (SIGSTOP) is served again when it comes back, whatever the pause's length."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from _spawn import CTX
from _workers import Inbox, build, collect, digest, mutate, receiver_main

from lightning_wsync import WeightSender
from lightning_wsync._push import membership as _membership

pytestmark = pytest.mark.timeout(180)
TIMEOUT_S = 2.0


def start(children, store, job, name, results, **options):
    p = CTX.Process(
        target=receiver_main, args=(store, job, name, ("mixed", 0), results.queue(name), options), daemon=True
    )
    p.start()
    children.track(p.pid)
    return p


def job_store(port: int, job: str) -> dist.Store:
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    return dist.PrefixStore(f"wsync/{job}", client)


def rid_of(sender: WeightSender, name: str) -> int:
    return next(m.rid for m in sender._members.members() if m.name == name and m.gone_reason is None)


def newest_held(results: Inbox, name: str, version: int, model_digest: str, within_s: float) -> None:
    """Wait until ``name`` reports ``version`` applied, with the sender's bytes."""
    deadline = time.monotonic() + within_s
    while True:
        got = collect(results, "version", {name}, timeout_s=max(0.1, deadline - time.monotonic()))[name]
        if got[2] == version:
            assert got[3] == model_digest, f"{name} applied version {version} with other bytes"
            return


def test_link_the_sender_dropped_is_rebuilt(children, port):
    """The sender's end of a link goes (a failed send, a store error, a close) while the
    receiver waits for the next announcement: the receiver notices within timeout_s that
    a newer version is out and builds a new group; the old link's keys are deleted."""
    model = build(("mixed", 0))
    results = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    with WeightSender(model, store=store, job="drop", transport="gloo", timeout_s=TIMEOUT_S) as sender:
        start(children, store, "drop", "r0", results, timeout_s=TIMEOUT_S)
        collect(results, "ready", {"r0"}, timeout_s=120)
        mutate(model, 1)
        assert sender.push(1).wait(timeout_s=60).delivered == ("r0",)
        newest_held(results, "r0", 1, digest(model), 30)
        member = next(m for m in sender._members.members() if m.name == "r0")
        old = sender._side.net._links.get(member.rid)
        assert old is not None
        old.close()

        mutate(model, 2)
        started = time.monotonic()
        handle = sender.push(2)
        assert handle.stall_s < TIMEOUT_S
        report = handle.wait(timeout_s=TIMEOUT_S + 20)
        assert report.delivered == ("r0",), report  # before: never (the receiver waited for ann/1 forever)
        took = time.monotonic() - started
        print(f"dropped link: version 2 delivered {took:.2f} s after the push (timeout_s={TIMEOUT_S})")
        assert took < TIMEOUT_S + 20
        newest_held(results, "r0", 2, digest(model), 30)
        new = sender._side.net._links.get(member.rid)
        assert new is not None and new.number > old.number

        prefix = f"pg/{sender.epoch}/{member.rid}/{old.number}/"
        left = [k for k in ("ready/0", "ready/1", "ann/0", "ann/1", "/0/0", "/0/1") if job_store(port, "drop").check(
            [prefix + k])]  # fmt: skip
        assert not left, f"keys of the dropped link left on the store: {left}"


@pytest.mark.parametrize("transport", ["gloo", "auto"])
def test_receiver_paused_past_every_timeout_catches_up(children, port, monkeypatch, transport):
    """r0 is SIGSTOPped until the sender has forgotten it (keys deleted); pushes go on and
    r1 is served within timeout_s throughout. After SIGCONT r0 registers again, holds the
    newest version bit-exact and is acknowledged in push reports."""
    monkeypatch.setattr(_membership, "_FORGET_AFTER", 3)  # forgotten after 3 s of silence, not 30
    model = build(("mixed", 0))
    results = Inbox(CTX)
    store, job = f"127.0.0.1:{port}", f"pause-{transport}"
    names = {"r0", "r1"}
    sender = WeightSender(model, store=store, job=job, transport=transport, timeout_s=TIMEOUT_S,
                          heartbeat_timeout_s=1.0)  # fmt: skip
    try:
        procs = {n: start(children, store, job, n, results, timeout_s=TIMEOUT_S, heartbeat_s=0.1) for n in names}
        collect(results, "ready", names, timeout_s=120)
        version = 1
        mutate(model, version)
        assert sorted(sender.push(version).wait(timeout_s=60).delivered) == ["r0", "r1"]
        for name in names:
            newest_held(results, name, version, digest(model), 30)
        rid = rid_of(sender, "r0")
        keys = job_store(port, job)

        os.kill(procs["r0"].pid, signal.SIGSTOP)
        paused_at = time.monotonic()
        try:
            forgotten = False
            while not forgotten or version < 4:  # pushes go on during the pause and after it is forgotten
                assert time.monotonic() - paused_at < 60, "the sender never forgot the paused receiver"
                version += 1
                mutate(model, version)
                handle = sender.push(version)
                started = time.monotonic()
                report = handle.wait()
                assert handle.stall_s < TIMEOUT_S and time.monotonic() - started <= TIMEOUT_S + 1
                assert "r1" in report.delivered, report
                newest_held(results, "r1", version, digest(model), 30)
                forgotten = forgotten or not keys.check([f"member/{rid}"])
                time.sleep(0.2)  # pacing: a push every ~0.2 s while r0 is stopped
            paused_s = time.monotonic() - paused_at
            assert paused_s > 3 * 1.0 and paused_s > TIMEOUT_S
        finally:
            os.kill(procs["r0"].pid, signal.SIGCONT)

        # Back: r0 is served again. Before, the sender never saw it again, and over the
        # network it never got another version.
        resumed_at = time.monotonic()
        deadline = resumed_at + 60
        while True:
            assert time.monotonic() < deadline, f"r0 was not served again after the pause (version {version})"
            version += 1
            mutate(model, version)
            report = sender.push(version).wait()
            assert "r1" in report.delivered, report
            if "r0" in report.delivered:
                break
            time.sleep(0.2)  # pacing
        newest_held(results, "r0", version, digest(model), 30)
        print(f"{transport}: paused {paused_s:.1f} s, forgotten, acknowledged again "
              f"{time.monotonic() - resumed_at:.2f} s after SIGCONT")  # fmt: skip
        assert rid_of(sender, "r0") != rid  # registered again under a fresh id
    finally:
        sender.close(flush_timeout_s=0)


@pytest.mark.parametrize("apply", ["copy", "swap"])
def test_receiver_stopped_during_a_send_is_served_after_resume(children, port, apply):
    """r0 is SIGSTOPped while the sender sends it a version: the sender's link fails after
    its timeout_s and lets go of the group. After SIGCONT r0 holds the next version within a
    few of the sender's timeout_s, not after its own (longer) timeout_s on the dead group."""
    spec = ("big", 16)  # 16 MiB: a send cannot hide in socket buffers
    model = build(spec)
    results = Inbox(CTX)
    store, job = f"127.0.0.1:{port}", f"midsend-{apply}"
    receiver_timeout_s = 60.0  # what a stuck receive on the dead group would cost
    with WeightSender(model, store=store, job=job, transport="gloo", timeout_s=TIMEOUT_S) as sender:
        options = {"apply": apply, "timeout_s": receiver_timeout_s}
        p = CTX.Process(target=receiver_main, args=(store, job, "r0", spec, results.queue("r0"), options), daemon=True)
        p.start()
        children.track(p.pid)
        collect(results, "ready", {"r0"}, timeout_s=120)
        mutate(model, 1)
        assert sender.push(1).wait(timeout_s=60).delivered == ("r0",)
        newest_held(results, "r0", 1, digest(model), 30)
        rid = rid_of(sender, "r0")

        mutate(model, 2)
        # Stopped before the push, not just after it: a push's send can finish in ~30 ms, before
        # a SIGSTOP sent after push() lands (seen: v2 delivered). r0 already asked for its next
        # version, so the sender's send of 16 MiB starts at once and blocks on the stopped process.
        os.kill(p.pid, signal.SIGSTOP)
        handle = sender.push(2)
        try:
            report = handle.wait(timeout_s=TIMEOUT_S + 5)
            assert "r0" not in report.delivered, report
            deadline = time.monotonic() + TIMEOUT_S + 10
            while (link := sender._side.net._links.get(rid)) is None or link.error is None:
                assert time.monotonic() < deadline, "the sender's link to the stopped receiver never failed"
                time.sleep(0.05)  # polling the sender's own state, bounded by the deadline
        finally:
            os.kill(p.pid, signal.SIGCONT)
        resumed = time.monotonic()
        mutate(model, 3)
        sender.push(3)
        newest_held(results, "r0", 3, digest(model), 4 * TIMEOUT_S + 5)
        print(f"{apply}: version 3 held {time.monotonic() - resumed:.2f} s after SIGCONT")
