"""Integrity and failure behaviour: corrupted bytes, store loss, memory over many pushes."""

from __future__ import annotations

import os
import time

import pytest
import torch
from _spawn import CTX
from _workers import (
    Inbox,
    build,
    collect,
    corrupt_newest_slot,
    corrupting_receiver_main,
    digest,
    mutate,
    receiver_main,
    sender_main,
)

from lightning_wsync import WeightReceiver, WeightSender, WeightSyncStoreError

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
def test_corrupted_bytes_are_rejected_and_previous_version_kept(children, port):
    spec = ("mixed", 0)
    model = build(spec)
    inbox = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    with WeightSender(model, store=store, job="corrupt", transport="gloo", timeout_s=10) as sender:
        p = CTX.Process(target=corrupting_receiver_main,
                        args=(store, "corrupt", "r", spec, inbox.queue("r"), {}, 2), daemon=True)  # fmt: skip
        p.start()
        children.track(p.pid)
        collect(inbox, "ready", {"r"}, timeout_s=120)
        mutate(model, 1)
        assert sender.push(1).wait(30).delivered == ("r",)
        assert collect(inbox, "version", {"r"}, 30)["r"][2:4] == (1, digest(model))

        mutate(model, 2)
        report = sender.push(2).wait(30)
        assert report.delivered == ()
        assert report.failed["r"].startswith("rejected version 2: checksum mismatch in 1 bucket(s)")

        mutate(model, 3)
        assert sender.push(3).wait(30).delivered == ("r",)
        # The next version applied is 3, bit-exact; 2 never reached the module.
        assert collect(inbox, "version", {"r"}, 30)["r"][2:4] == (3, digest(model))


@pytest.mark.slow
def test_store_loss_keeps_weights_and_reports_clearly(children, port):
    spec = ("mixed", 0)
    inbox = Inbox(CTX)
    p = CTX.Process(target=sender_main, args=(port, "lost", spec, inbox.queue("sender")), daemon=True)
    p.start()
    children.track(p.pid)
    pushed = collect(inbox, "pushed", {"sender"}, timeout_s=120)["sender"]
    module = build(spec)
    with WeightReceiver(module, store=f"127.0.0.1:{port}", job="lost", timeout_s=3) as receiver:
        assert receiver.wait_for_version(1, timeout_s=30) == 1
        assert digest(module) == pushed[3]
        os.kill(p.pid, 9)
        deadline = time.monotonic() + 30
        while receiver.store_lost_s is None:  # bounded poll on the receiver's own state
            assert time.monotonic() < deadline, "receiver never noticed the store went away"
            time.sleep(0.05)
        assert receiver.update() is None
        unreachable = rf"store '127.0.0.1:{port}' has been unreachable .* keeps version 1"
        with pytest.raises(WeightSyncStoreError, match=unreachable):
            receiver.wait_for_version(2, timeout_s=3)
        assert digest(module) == pushed[3]


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_memory_flat_over_many_small_pushes(children, port):
    spec = ("mixed", 0)
    model = build(spec)
    inbox = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    pushes = 1000
    with WeightSender(model, store=store, job="rss", timeout_s=10) as sender:
        p = CTX.Process(target=receiver_main, args=(store, "rss", "r", spec, inbox.queue("r"), {}), daemon=True)
        p.start()
        children.track(p.pid)
        collect(inbox, "ready", {"r"}, timeout_s=120)
        rss: dict[int, tuple[int, int]] = {}  # version -> (sender KiB, receiver KiB)
        for version in range(1, pushes + 1):
            with torch.no_grad():
                model[0].bias[0] = version
            assert sender.push(version).wait(30).delivered == ("r",)
            got = collect(inbox, "version", {"r"}, 30)["r"]
            assert got[2:4] == (version, digest(model))
            if version in (pushes // 10, pushes):
                rss[version] = (_rss_kib(), got[4])
        for side in (0, 1):
            growth = rss[pushes][side] / rss[pushes // 10][side] - 1
            assert growth < 0.05, rss


def test_a_verifying_receiver_that_joins_after_a_push_gets_that_version(port):
    """The checksums of a version pushed while no receiver verified are published when one joins (before, a
    late receiver with verify=True waited for the next push and timed out: 'no version >= 0 within ...')."""
    src, dst = build(("mixed", 0)), build(("mixed", 1))
    store = f"127.0.0.1:{port}"
    with WeightSender(src, store=store, job="late-verify", timeout_s=10) as sender:
        sender.push(0).wait(10)
        with WeightReceiver(dst, store=store, job="late-verify", name="late", verify=True) as receiver:
            assert receiver.wait_for_version(0, timeout_s=10) == 0
            assert digest(dst) == digest(src)
            mutate(src, 1)
            sender.push(1)
            assert receiver.wait_for_version(1, timeout_s=10) == 1
            assert digest(dst) == digest(src)


def test_shared_memory_verify_rejects_corrupted_bytes(port):
    src, dst = build(("mixed", 0)), build(("mixed", 1))
    store = f"127.0.0.1:{port}"
    with WeightSender(src, store=store, job="shm-verify", timeout_s=10) as sender:
        with WeightReceiver(dst, store=store, job="shm-verify", name="careful", verify=True) as receiver:
            mutate(src, 1)
            sender.push(1)
            assert receiver.wait_for_version(1, timeout_s=10) == 1
            held = digest(dst)
            mutate(src, 2)
            handle = sender.push(2)
            deadline = time.monotonic() + 10
            corrupt_newest_slot(sender, "shm-verify", 2, deadline)  # a bit flips after the snapshot
            while receiver.rejected == 0:
                assert time.monotonic() < deadline, "the corrupted version was never checked"
                assert receiver.update() is None
                time.sleep(0.005)
            assert receiver.version == 1 and digest(dst) == held  # the previous version is kept
            report = handle.wait(10)
            assert report.failed["careful"].startswith("rejected version 2: checksum mismatch in shared memory")
            mutate(src, 3)
            sender.push(3)
            assert receiver.wait_for_version(3, timeout_s=10) == 3
            assert digest(dst) == digest(src)
