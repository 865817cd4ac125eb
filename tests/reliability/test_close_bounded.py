"""WeightSender.close() takes a bounded total time and leaks nothing: with several
receivers stalled mid-receive (SIGSTOP), and with the store's process killed."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from _spawn import CTX
from _workers import Inbox, build, collect, mutate, receiver_main

from lightning_wsync import WeightSender
from lightning_wsync._planes.nixl import open as nixl_plane

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
SPEC = ("big", 32)  # 32 MiB: a send to a stopped receiver blocks (far more than the socket buffers)


def start(children, store, job, name, results, spec=SPEC):
    p = CTX.Process(target=receiver_main, args=(store, job, name, spec, results.queue(name), {}), daemon=True)
    p.start()
    children.track(p.pid)
    return p


def wsync_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("wsync-") and t.is_alive()]


def sending(sender: WeightSender, keys: dist.Store, count: int) -> bool:
    """``count`` links announced version 2's send (their receivers, stopped, never read it)."""
    links = list(sender._side.net._links.values())
    return sum(bool(keys.check([f"pg/{sender.epoch}/{link.rid}/{link.number}/ann/1"])) for link in links) >= count


def store_main(port: int) -> None:
    """Host the job's TCPStore (as `lightning-wsync store` would) until killed."""
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    while store is not None:
        time.sleep(1)


@pytest.mark.parametrize("flush_timeout_s", [0.0, None])
def test_close_with_stalled_receivers_is_bounded_whatever_their_count(children, port, monkeypatch, flush_timeout_s):
    timeout_s = 8.0
    model = build(SPEC)
    results = Inbox(CTX)
    store, job, names = f"127.0.0.1:{port}", "close", {"r0", "r1", "r2", "r3"}
    # The sends under test are gloo links: where NIXL is installed, transport="auto" would serve this
    # star over NIXL (one-sided READs, no sends to stall), so the sender is told NIXL is not usable.
    monkeypatch.setattr(nixl_plane, "unusable", lambda: "not used by this test (gloo links under test)")
    sender = WeightSender(model, store=store, job=job, timeout_s=timeout_s, cross_host="star")
    segment = f"/dev/shm/{sender._ring.segment.name}"
    try:
        monkeypatch.setenv("WSYNC_HOST_ID", "rollout-host")  # inherited by the receivers: served over gloo
        procs = {n: start(children, store, job, n, results) for n in sorted(names)}
        monkeypatch.delenv("WSYNC_HOST_ID")
        collect(results, "ready", names, timeout_s=120)
        assert sorted(sender.push(1).wait(timeout_s=120).delivered) == sorted(names)
        collect(results, "version", names, timeout_s=60)
        for p in procs.values():
            os.kill(p.pid, signal.SIGSTOP)
        mutate(model, 2)
        sender.push(2)
        deadline = time.monotonic() + 30
        keys = dist.PrefixStore(f"wsync/{job}", dist.TCPStore("127.0.0.1", port, is_master=False))
        while not sending(sender, keys, len(names)):
            assert time.monotonic() < deadline, "the sends to the stopped receivers never started"
            time.sleep(0.01)
        started = time.monotonic()
        sender.close(flush_timeout_s=flush_timeout_s)
        took = time.monotonic() - started
    finally:
        sender.close(flush_timeout_s=0)
        for p in procs.values():
            os.kill(p.pid, signal.SIGCONT)
    print(f"close(flush_timeout_s={flush_timeout_s}) with {len(names)} stalled receivers: {took:.2f} s")
    flush = timeout_s if flush_timeout_s is None else flush_timeout_s
    # Before: each stalled link was joined in turn for up to 5 s (about timeout_s in all
    # after flush_timeout_s=0, ~4x the bound below; N x 5 s with more receivers).
    assert took < flush + 2.0, f"close() took {took:.1f} s with {len(names)} stalled receivers"
    assert not os.path.exists(segment)
    assert wsync_threads() == []


def test_close_after_the_store_died_frees_everything(children, port):
    store_proc = CTX.Process(target=store_main, args=(port,), daemon=True)
    store_proc.start()
    children.track(store_proc.pid)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))  # waits for it
    del client
    model = build(("mixed", 0))
    results = Inbox(CTX)
    store, timeout_s = f"127.0.0.1:{port}", 3.0
    sender = WeightSender(model, store=store, job="gone", timeout_s=timeout_s, cross_host="star")
    assert not sender._store.is_server
    segment = f"/dev/shm/{sender._ring.segment.name}"
    try:
        start(children, store, "gone", "r0", results, ("mixed", 0))
        collect(results, "ready", {"r0"}, timeout_s=120)
        assert sender.push(1).wait(timeout_s=60).delivered == ("r0",)
        os.kill(store_proc.pid, signal.SIGKILL)
        store_proc.join(timeout=10)
        mutate(model, 2)
        sender.push(2)
        started = time.monotonic()
        sender.close(flush_timeout_s=1.0)  # before: raised WeightSyncStoreError, leaving the ring and threads
        took = time.monotonic() - started
    finally:
        sender.close(flush_timeout_s=0)
    print(f"close(flush_timeout_s=1.0) with the store gone: {took:.2f} s")
    assert took < 1.0 + timeout_s + 2.0, took
    assert not os.path.exists(segment)
    assert wsync_threads() == []
