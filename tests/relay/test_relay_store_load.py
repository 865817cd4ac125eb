"""The relay's control plane grows with hosts, not receivers (issue 22): host-mates ask the store
almost nothing, at idle and per push, because their leader speaks for the host.

One simulated host (``WSYNC_HOST_ID``) runs its leader in one process and three host-mates in
another; each process reaches the store through a counting proxy of its own
(:mod:`lightning_wsync.testing.storeproxy`), so the host-mates' requests are counted apart
from the leader's and the sender's. Before: each host-mate read its leader's record and the
chain every 50 ms and ``news`` every 0.1 s (~35 requests/s each at idle, ~6 per push).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_wsync import WeightSender
from lightning_wsync._control.store import Control
from lightning_wsync._planes.relay.head import leader_record
from lightning_wsync.testing.hostproc import HostArgs, host_main
from lightning_wsync.testing.models import build_model, digest, mutate, spec_for_size
from lightning_wsync.testing.procs import receive
from lightning_wsync.testing.storeproxy import CountingProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

HOST = "simhost-load"
MATES = ["m1", "m2", "m3"]
IDLE_S = 3.0
HEARTBEAT_TIMEOUT_S = 8.0  # relay receivers beat every quarter of it: 2 s


def _wait(what: str, condition, timeout_s: float = 60):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)
    return result


def _keys(counts: Counter[str]) -> dict[str, int]:
    """``"compare_set /wsync/<job>/member/#/hb"`` -> ``"member/#/hb"`` (summed over commands)."""
    out: Counter[str] = Counter()
    for k, v in counts.items():
        out[k.split("/", 3)[-1]] += v
    return dict(out)


def test_host_mates_ask_the_store_almost_nothing_at_idle_and_per_push(children, monkeypatch, port) -> None:
    spec = spec_for_size(1)
    model = build_model(spec, seed=0)
    job = f"load-{port}"
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True,
                           timeout=timedelta(seconds=30))  # fmt: skip
    with CountingProxy("127.0.0.1", port) as lead_proxy, CountingProxy("127.0.0.1", port) as mates_proxy:
        with monkeypatch.context() as env:
            env.setenv("WSYNC_HOST_ID", "trainer-host")
            sender = WeightSender(model, store=f"127.0.0.1:{port}", job=job, timeout_s=20, cross_host="relay",
                                  heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)  # fmt: skip
        with sender:
            mutate(model, 1)
            sender.push(1)
            lead = children.start(host_main, (HostArgs(lead_proxy.address, job, ["lead"], HOST, spec, 20.0),),
                                  name="wsync-test-lead")  # fmt: skip
            receive(lead, 60, "the leader to start")
            ctl = Control(server, job)
            record = _wait("the first receiver to lead its host", lambda: leader_record(ctl, sender.epoch, HOST))
            mates = children.start(host_main, (HostArgs(mates_proxy.address, job, MATES, HOST, spec, 20.0),),
                                   name="wsync-test-mates")  # fmt: skip
            receive(mates, 60, "the host-mates to start")

            def push(version: int) -> Counter[str]:
                before = mates_proxy.snapshot_keys()
                if version > 1:
                    mutate(model, version)
                    sender.push(version)
                want = digest(model)
                for conn in (lead, mates):
                    conn.send(("await", version))
                for conn in (lead, mates):
                    got = receive(conn, 60, f"version {version} applied")
                    assert got[0] == "applied" and set(got[2]) == {want}, got  # type: ignore[arg-type]
                return mates_proxy.snapshot_keys() - before

            push(1)
            assert leader_record(ctl, sender.epoch, HOST) == record  # the mates joined without taking over
            before = mates_proxy.snapshot_keys()
            time.sleep(IDLE_S)  # the measuring window itself
            idle = mates_proxy.snapshot_keys() - before
            per_push = [push(v) for v in (2, 3, 4)]
            for conn in (lead, mates):
                conn.send(("close",))
            for conn in (lead, mates):
                receive(conn, 30, "the receivers to close")

    # At idle the three host-mates only beat (a quarter of heartbeat_timeout_s apart): no polls
    # of the leader's record, the chain or news (before: ~35 requests/s each). An acknowledgement
    # of version 1 written just after the window opened may be in it too.
    assert set(_keys(idle)) <= {"member/#/hb", "member/#/state"}, _keys(idle)
    beats = len(MATES) * (IDLE_S / (HEARTBEAT_TIMEOUT_S / 4) + 1)
    assert sum(idle.values()) <= beats + len(MATES), _keys(idle)
    # Per push each acknowledges what it holds (1 request); it learns of the version from its
    # leader's board and ring, not from the store (before: news and four records, ~6 each).
    median = statistics.median(sum(c.values()) for c in per_push)
    assert median <= 2 * len(MATES), [_keys(c) for c in per_push]
    assert mates_proxy.unparsed == 0 and lead_proxy.unparsed == 0
