"""Delta pushes end to end: real sender, receiver processes, gloo; every version bit-exact."""

from __future__ import annotations

import os
import signal

import pytest
from _delta_workers import delta_sender
from _spawn import CTX
from _workers import (
    Inbox,
    build,
    collect,
    corrupting_receiver_main,
    digest,
    receiver_main,
    sparse_change,
)

from lightning_wsync import WeightSender
from lightning_wsync.testing.stores import host_store

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
SPEC = ("big", 8)  # 8 MiB of float32 in 1024x1024 matrices: 4 buckets of 2 MiB


def _start(children, store, job, name, inbox, target=receiver_main, extra=(), **options):
    p = CTX.Process(target=target, args=(store, job, name, SPEC, inbox.queue(name), options, *extra), daemon=True)
    p.start()
    children.track(p.pid)
    return p


def _push(sender, model, version, names, inbox):
    sparse_change(model, version)
    # A push whose delivery is asserted waits for a slot: under load the previous version's send or
    # delta encoding may still hold one when its report is in, and a dropped push is by design.
    report = sender.push(version, wait_for_slot_s=30).wait(timeout_s=60)
    got = collect(inbox, "version", names, timeout_s=60)
    assert {n: m[2:4] for n, m in got.items()} == {n: (version, digest(model)) for n in names}, report
    return report


def test_deltas_after_one_full_version_late_join_restart_and_stall(children, port):
    model = build(SPEC)
    inbox = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    job = "delta"
    options = dict(transport="gloo", bucket_mb=2, timeout_s=4, delta="always")
    with WeightSender(model, store=store, job=job, **options) as sender:
        procs = {"copy": _start(children, store, job, "copy", inbox),
                 "swap": _start(children, store, job, "swap", inbox, apply="swap")}  # fmt: skip
        collect(inbox, "ready", set(procs), timeout_s=120)
        names = set(procs)
        first = _push(sender, model, 1, names, inbox)
        assert first.delta_receivers == ()  # nothing held yet: full versions
        report = _push(sender, model, 2, names, inbox)
        assert sorted(report.delta_receivers) == ["copy", "swap"]
        assert report.delta_bytes is not None and report.delta_bytes < 0.1 * report.bytes
        assert report.delta_changed_share == pytest.approx(1 / 97, rel=0.05)
        assert report.delta_encode_s is not None and report.delta_encode_s > 0

        _start(children, store, job, "late", inbox)  # late join: the newest version in full at once
        assert collect(inbox, "version", {"late"}, timeout_s=120)["late"][2:4] == (2, digest(model))
        names.add("late")
        report = _push(sender, model, 3, names, inbox)
        assert sorted(report.delta_receivers) == ["copy", "late", "swap"]

        os.kill(procs["copy"].pid, signal.SIGKILL)  # restart: it holds nothing, gets a full version
        sparse_change(model, 4)
        sender.push(4, wait_for_slot_s=30).wait(timeout_s=30)
        procs["copy"] = _start(children, store, job, "copy", inbox)
        assert collect(inbox, "version", {"copy"}, timeout_s=120)["copy"][2:4] == (4, digest(model))
        collect(inbox, "version", names - {"copy"}, timeout_s=60)
        report = _push(sender, model, 5, names, inbox)
        assert sorted(report.delta_receivers) == ["copy", "late", "swap"], report

        os.kill(procs["swap"].pid, signal.SIGSTOP)  # misses versions 6 and 7: its base leaves the ring
        try:
            for version in (6, 7):
                sparse_change(model, version)
                report = sender.push(version, wait_for_slot_s=30).wait(timeout_s=30)
                assert "swap" in report.failed and "swap" not in report.delta_receivers
                collect(inbox, "version", names - {"swap"}, timeout_s=60)
        finally:
            os.kill(procs["swap"].pid, signal.SIGCONT)
        # It comes back holding 5; the ring holds 6 and 7: the newest version in full, then deltas.
        assert collect(inbox, "version", {"swap"}, timeout_s=120)["swap"][2:4] == (7, digest(model))
        report = _push(sender, model, 8, names, inbox)
        assert sorted(report.delta_receivers) == ["copy", "late", "swap"]


def test_corrupted_delta_is_rejected_previous_kept_then_full_then_deltas(children, port):
    model = build(SPEC)
    inbox = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    options = dict(transport="gloo", bucket_mb=2, timeout_s=10, delta="always")
    with WeightSender(model, store=store, job="bad", **options) as sender:
        _start(children, store, "bad", "r", inbox, target=corrupting_receiver_main, extra=(3,))
        collect(inbox, "ready", {"r"}, timeout_s=120)
        _push(sender, model, 1, {"r"}, inbox)
        assert _push(sender, model, 2, {"r"}, inbox).delta_receivers == ("r",)
        sparse_change(model, 3)
        report = sender.push(3, wait_for_slot_s=30).wait(timeout_s=30)
        assert report.delivered == () and report.delta_receivers == ("r",)
        assert report.failed["r"].startswith("rejected version 3: checksum mismatch in 1 bucket(s)"), report
        report = _push(sender, model, 4, {"r"}, inbox)  # 3 never reached the module; 4 comes in full
        assert report.delta_receivers == ()
        assert _push(sender, model, 5, {"r"}, inbox).delta_receivers == ("r",)


def test_sender_restart_sends_full_then_deltas(children, port):

    keep = host_store("127.0.0.1", port, timeout_s=300)  # outlives the senders
    store = f"127.0.0.1:{port}"
    inbox = Inbox(CTX)
    _start(children, store, "again", "r", inbox)
    collect(inbox, "ready", {"r"}, timeout_s=120)
    first = CTX.Process(target=delta_sender, args=(port, "again", SPEC, inbox.queue("sender")), daemon=True)
    first.start()
    children.track(first.pid)
    for version in (1, 2):
        pushed = collect(inbox, "pushed", {"sender"}, timeout_s=120)["sender"]
        assert pushed[2] == version and pushed[4] == (() if version == 1 else ("r",))
        assert collect(inbox, "version", {"r"}, timeout_s=60)["r"][2:4] == (version, pushed[3])
    os.kill(first.pid, signal.SIGKILL)  # the trainer dies; its restart publishes a new sender epoch
    model = build(SPEC)
    sparse_change(model, 1)
    sparse_change(model, 2)
    options = dict(transport="gloo", bucket_mb=2, timeout_s=10, delta="always")
    with WeightSender(model, store=store, job="again", **options) as sender:
        # The receiver holds version 2 of the dead sender: no shared base, so a full version first.
        assert _push(sender, model, 3, {"r"}, inbox).delta_receivers == ()
        assert _push(sender, model, 4, {"r"}, inbox).delta_receivers == ("r",)
    del keep
