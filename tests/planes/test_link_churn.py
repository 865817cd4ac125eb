"""Receivers that come and go for days must not cost the sender a thread or a file
descriptor each: a gone receiver's network link is stopped and dropped (its process
group with it), and a retired receiver is forgotten."""

from __future__ import annotations

import gc
import os
import time

import pytest
from _spawn import CTX
from _workers import Inbox, build, collect, digest, mutate, receiver_main

from lightning_wsync import WeightSender
from lightning_wsync._push import membership as _membership

HEARTBEAT_TIMEOUT_S = 1.0


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fds() -> int:
    """Open descriptors other than pipes (each child's result queue is a pipe the test keeps)."""
    kinds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            kinds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return sum(not k.startswith("pipe:") for k in kinds)


def _settled(sender: WeightSender, within_s: float) -> bool:
    """Every receiver gone, its link dropped and its thread ended, and its record forgotten."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if sender._side.net.links() == 0 and not sender._members.members():
            gc.collect()  # a dropped link's process group goes with its last reference
            return True
        time.sleep(0.05)  # polling a condition with a deadline, not synchronising on time
    return False


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sender_threads_and_fds_stay_bounded_while_network_receivers_come_and_go(children, port, monkeypatch):
    monkeypatch.setattr(_membership, "_FORGET_AFTER", 2)  # a retired receiver is forgotten 2 s after retiring
    model = build(("mixed", 0))
    results = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    counts: list[tuple[int, int]] = []
    with WeightSender(model, store=store, job="churn", transport="gloo", timeout_s=5.0,
                      heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as sender:  # fmt: skip
        for round_ in range(6):
            name = f"r{round_}"
            p = CTX.Process(target=receiver_main, args=(store, "churn", name, ("mixed", 0), results.queue(name),
                                                        {"timeout_s": 5.0}), daemon=True)  # fmt: skip
            p.start()
            children.track(p.pid)
            collect(results, "ready", {name}, timeout_s=60)
            mutate(model, round_ + 1)
            report = sender.push(round_ + 1).wait(timeout_s=60)
            assert report.delivered == (name,), report
            got = collect(results, "version", {name}, timeout_s=30)[name]
            assert got[2] == round_ + 1 and got[3] == digest(model)
            p.kill()  # SIGKILL: no goodbye; the sender finds the process gone
            p.join(timeout=10)
            assert _settled(sender, within_s=30), f"round {round_}: the gone receiver's link or record is still held"
            counts.append((_threads(), _fds()))
    print("threads, fds after each round:", counts)
    first_threads, first_fds = counts[0]
    last_threads, last_fds = counts[-1]
    # Before: each gone receiver kept its link's aborted gloo group (3 threads, 5 fds) for good.
    assert last_threads <= first_threads + 2, counts
    assert last_fds <= first_fds + 3, counts
