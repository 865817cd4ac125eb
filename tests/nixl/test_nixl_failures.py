"""The NIXL plane under failure, through real processes on simulated hosts (each its own
``WSYNC_HOST_ID``): a reader or the owner killed mid-READ, a reader stopped past timeout_s,
a slot rewritten under a slow reader, garbled agent metadata. Never a torn or unverified
version, the others unaffected, nothing left behind."""

from __future__ import annotations

import base64
import json
import os
import queue
import signal
import threading
import time

import pytest
import torch
from _nixl_workers import remote_receiver_main, remote_sender_main
from _spawn import CTX
from _workers import Inbox, build, collect, digest, mutate, receiver_main

from lightning_wsync import WeightSender
from lightning_wsync._planes.nixl.agent import Agent, unusable

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow,
              pytest.mark.skipif(unusable() is not None, reason=f"{unusable()}")]  # fmt: skip
BIG = ("big", 32)  # two 16 MiB chunk READs


def start(children, store, job, name, spec, results, *, remote=True, **options):
    target = remote_receiver_main if remote else receiver_main
    p = CTX.Process(target=target, args=(store, job, name, spec, results.queue(name), options), daemon=True)
    p.start()
    children.track(p.pid)
    return p


def versions_until(inbox: Inbox, name: str, version: int, timeout_s: float) -> list[tuple[int, str]]:
    """Every (version, digest) ``name`` reports until it reports ``version`` or a newer one."""
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout_s
    while not seen or seen[-1][0] < version:
        assert time.monotonic() < deadline, f"{name} reported {seen}, never {version}"
        try:
            msg = inbox.queues[name].get(timeout=0.05)
        except queue.Empty:
            continue
        assert msg[0] != "error", msg
        if msg[0] == "version":
            seen.append((msg[2], msg[3]))
    return seen


def os_threads() -> list[str]:
    """This process's threads (their names) but torch's TCPStore server loop (a hosted store outlives its sender)."""
    comms = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            comms.append(f.read().strip())
    return sorted(c for c in comms if c != "pt_tcpstore_uv")


def test_reader_killed_mid_read_leaves_the_others_and_nothing_behind(children, port):
    Agent("wsync-warmup").close()  # UCX keeps one thread per process after its first agent
    model = build(BIG)
    mutate(model, 0)
    torch.empty(64 << 20, dtype=torch.uint8).copy_(torch.ones(64 << 20, dtype=torch.uint8))  # torch's thread pool
    threads = os_threads()
    results = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    names = {"r0", "r1", "r2"}
    with WeightSender(model, store=store, job="kill", transport="nixl", cross_host="star", timeout_s=4) as sender:
        procs = {n: start(children, store, "kill", n, BIG, results) for n in sorted(names)}
        collect(results, "ready", names, timeout_s=120)
        assert sorted(sender.push(1).wait(timeout_s=60).delivered) == sorted(names)
        collect(results, "version", names, timeout_s=60)
        for version in (2, 3, 4):
            mutate(model, version)
            handle = sender.push(version)
            if version == 2:
                time.sleep(0.02)  # its READ under way
                os.kill(procs["r0"].pid, signal.SIGKILL)
            report = handle.wait(timeout_s=30)
            assert {"r1", "r2"} <= set(report.delivered), report
            got = collect(results, "version", {"r1", "r2"}, timeout_s=60)
            assert {(m[2], m[3]) for m in got.values()} == {(version, digest(model))}
        key = "wsync/kill/nixl/1/agent/sender"
        assert sender.store.check([key])
    assert not sender.store.check([key])  # the owner's record went with it
    assert os_threads() == threads, [t.name for t in threading.enumerate()]  # its agent's and its own


def test_owner_killed_mid_read_nothing_torn_and_a_new_sender_is_followed(children, port, server):
    results = Inbox(CTX)
    commands = CTX.Queue()
    store = f"127.0.0.1:{port}"
    owner = CTX.Process(target=remote_sender_main, args=(port, "own", BIG, commands, results.queue("sender")),
                        daemon=True)  # fmt: skip
    owner.start()
    children.track(owner.pid)
    collect(results, "ready", {"sender"}, timeout_s=120)
    names = {"r0", "r1"}
    for n in sorted(names):
        start(children, store, "own", n, BIG, results)
    collect(results, "ready", names, timeout_s=120)
    commands.put(1)
    pushed = {1: collect(results, "pushing", {"sender"}, timeout_s=60)["sender"][3]}
    for n in names:
        assert versions_until(results, n, 1, 60) == [(1, pushed[1])]
    commands.put(2)
    pushed[2] = collect(results, "pushing", {"sender"}, timeout_s=60)["sender"][3]
    time.sleep(0.03)
    os.kill(owner.pid, signal.SIGKILL)
    model = build(BIG)
    mutate(model, 10)
    with WeightSender(model, store=store, job="own", transport="nixl", cross_host="star", timeout_s=5) as sender:
        sender.push(10).wait(timeout_s=60)
        for n in names:  # version 2 or not, but never a torn one; then the new sender's version
            seen = versions_until(results, n, 10, 60)
            assert seen[-1] == (10, digest(model)), seen
            assert all(d == pushed[v] for v, d in seen[:-1]), seen


def test_reader_stopped_past_timeout_holds_nothing_and_catches_up(children, port):
    model = build(BIG)
    results = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    names = {"r0", "r1", "r2"}
    timeout_s = 2.0
    pushed: dict[int, str] = {}
    with WeightSender(model, store=store, job="stop", transport="nixl", cross_host="star",
                      timeout_s=timeout_s) as sender:  # fmt: skip
        procs = {n: start(children, store, "stop", n, BIG, results) for n in sorted(names)}
        collect(results, "ready", names, timeout_s=120)
        for version in (1, 2, 3, 4):
            mutate(model, version)
            pushed[version] = digest(model)
            handle = sender.push(version)
            if version == 2:
                time.sleep(0.02)
                os.kill(procs["r0"].pid, signal.SIGSTOP)
            report = handle.wait(timeout_s=30)
            assert {"r1", "r2"} <= set(report.delivered), report
            assert report.version == version and not report.dropped
            for n in ("r1", "r2"):
                assert versions_until(results, n, version, 30)[-1] == (version, pushed[version])
            if version == 2:
                time.sleep(timeout_s + 1)  # r0 stays stopped past timeout_s and the lease
        os.kill(procs["r0"].pid, signal.SIGCONT)
        seen = versions_until(results, "r0", 4, 60)
        assert seen[-1] == (4, pushed[4]) and all(d == pushed[v] for v, d in seen), seen


def test_slot_rewritten_under_a_slow_reader_is_read_again(children, port):
    model = build(BIG)
    results = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    timeout_s = 2.0  # the owner's lease: min(timeout_s, heartbeat_timeout_s, 5 s)
    pushed: dict[int, str] = {}
    with WeightSender(model, store=store, job="slow", transport="nixl", cross_host="star", timeout_s=timeout_s,
                      heartbeat_timeout_s=30) as sender:  # fmt: skip
        start(children, store, "slow", "r0", BIG, results, stall_first_chunk_s=3 * timeout_s, timeout_s=30)
        collect(results, "ready", {"r0"}, timeout_s=120)

        def push(version: int) -> None:
            mutate(model, version)
            pushed[version] = digest(model)
            handles.append(sender.push(version))

        handles: list = []

        push(1)
        assert versions_until(results, "r0", 1, 60) == [(1, pushed[1])]
        push(2)
        collect(results, "stalling", {"r0"}, timeout_s=30)  # half of version 2 READ, then asleep
        time.sleep(timeout_s + 0.5)  # past the lease: the owner may rewrite version 2's slot
        push(3)  # into version 1's slot
        push(4)  # into version 2's: rewritten under the stalled READ
        assert not any(h.wait(timeout_s=30).dropped for h in handles)
        seen = versions_until(results, "r0", 4, 60)
        assert seen[-1] == (4, pushed[4]) and all(d == pushed[v] for v, d in seen), seen
        assert 2 not in [v for v, _ in seen]  # its READ was torn: never applied


def test_garbled_agent_metadata_stops_only_its_readers(children, port):
    model = build(("mixed", 0))
    results = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    with WeightSender(model, store=store, job="garb", transport="nixl", cross_host="star", timeout_s=5) as sender:
        key = "wsync/garb/nixl/1/agent/sender"
        good = sender.store.get(key)
        record = json.loads(good)
        metadata = base64.b64decode(record["metadata"])
        cut = base64.b64encode(metadata[: len(metadata) // 2]).decode()  # a record, but NIXL refuses its metadata
        loads_not = json.dumps({**record, "metadata": cut}).encode()
        sender.store.set(key, b"\x00garbage")  # not a record at all
        remotes = {"r0", "r1"}
        for n in sorted(remotes):
            start(children, store, "garb", n, ("mixed", 0), results)
        start(children, store, "garb", "local", ("mixed", 0), results, remote=False)
        collect(results, "ready", remotes | {"local"}, timeout_s=120)
        for version, garbled in ((1, None), (2, loads_not)):
            if garbled is not None:
                sender.store.set(key, garbled)
            mutate(model, version)
            sender.push(version)
            assert collect(results, "version", {"local"}, timeout_s=60)["local"][2:4] == (version, digest(model))
            time.sleep(2)
            for n in remotes:  # nothing applied from an agent that did not load
                with pytest.raises(queue.Empty):
                    while True:
                        msg = results.queues[n].get(timeout=0.01)
                        assert msg[0] != "version", msg
        sender.store.set(key, good)  # its writer's record again: they follow
        mutate(model, 3)
        sender.push(3)
        got = collect(results, "version", remotes | {"local"}, timeout_s=60)
        assert {(m[2], m[3]) for m in got.values()} == {(3, digest(model))}
