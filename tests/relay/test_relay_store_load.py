"""The relay's control plane grows with hosts, not receivers (issue 22): host-mates ask the store
almost nothing, at idle and per push, because their leader speaks for the host.

One simulated host (``WSYNC_HOST_ID``) runs its leader in one process and three host-mates in
another; each process reaches the store through a counting proxy of its own
(:mod:`lightning_wsync.testing.storeproxy`), so the host-mates' requests are counted apart
from the leader's and the sender's. Before: each host-mate read its leader's record and the
chain every 50 ms and ``news`` every 0.1 s (~35 requests/s each at idle, ~6 per push); then
it still beat (a quarter of ``heartbeat_timeout_s`` apart) and acknowledged each version on
the store itself, which its leader now does for it (:mod:`lightning_wsync._planes.relay.mate.notes`).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import pytest

from lightning_wsync import WeightSender
from lightning_wsync._control import keys
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import timing
from lightning_wsync._planes.relay.head.feed import leader_record
from lightning_wsync.testing.hostproc import HostArgs, host_main
from lightning_wsync.testing.models import build_model, digest, mutate, spec_for_size
from lightning_wsync.testing.procs import receive
from lightning_wsync.testing.storeproxy import CountingProxy
from lightning_wsync.testing.stores import host_store

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


# What a host-mate's timed backstops read (its watcher every hosted_backstop_s, news or not: the
# sender pointer, the close, ``latest``; its relay member every leader_record_backstop_s: the leader's
# record), by design and whatever the host says. On a loaded machine one falls inside a push's
# window, so they are counted apart and bounded by the time the host-mates ran.
_BACKSTOP_KEYS = {"sender/current", "closed/#", "latest"}


def _backstop_rounds(elapsed_s: float) -> int:
    """How many backstop rounds the host-mates can have had (each looks once as it starts,
    before any window here, then once per period)."""
    t = timing(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, timeout_s=20.0)  # as the sender below
    return len(MATES) * int(elapsed_s // min(t.hosted_backstop_s, t.leader_record_backstop_s))


def _split(counts: Counter[str]) -> tuple[dict[str, int], dict[str, int]]:
    """(requests a host-mate makes because of the push or the idle time, its timed backstops)."""
    keys = _keys(counts)
    backstop = {k: v for k, v in keys.items() if k in _BACKSTOP_KEYS or k.startswith("relay/")}
    return {k: v for k, v in keys.items() if k not in backstop}, backstop


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
    server = host_store("127.0.0.1", port, timeout_s=30, multi_tenant=True)
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
            mates_launched = time.monotonic()
            ctl = Control(server, job)
            # Its record once marked ready: read before that, the one compared at the end differs by ready alone.
            record = _wait("the first receiver to lead its host and mark its record ready",
                           lambda: (r := leader_record(ctl, sender.epoch, HOST)) is not None and r.ready and r)
            mates = children.start(host_main, (HostArgs(mates_proxy.address, job, MATES, HOST, spec, 20.0),),
                                   name="wsync-test-mates")  # fmt: skip
            receive(mates, 60, "the host-mates to start")

            everyone = {"lead", *MATES}
            lead_pushes: list[Counter[str]] = []  # the leader's requests in each push's window

            def push(version: int, *, after: int | None = None) -> Counter[str]:
                before, lead_before = mates_proxy.snapshot_keys(), lead_proxy.snapshot_keys()
                if after is not None:  # announced just before: the leader's board skips its bump
                    news = ctl.get_text(keys.NEWS)
                    mutate(model, after)
                    sender.push(after)
                    _wait(f"version {after} announced", lambda: ctl.get_text(keys.NEWS) != news)
                handle = None
                if version > 1:
                    mutate(model, version)
                    handle = sender.push(version)
                want = digest(model)
                for conn in (lead, mates):
                    conn.send(("await", version))
                for conn in (lead, mates):
                    got = receive(conn, 60, f"version {version} applied")
                    assert got[0] == "applied" and set(got[2]) == {want}, got  # type: ignore[arg-type]
                if handle is not None:  # the leader's writes of the host-mates' acknowledgements
                    report = handle.wait(timeout_s=30)
                    assert everyone <= set(report.delivered) and not report.failed, report
                lead_pushes.append(lead_proxy.snapshot_keys() - lead_before)
                return mates_proxy.snapshot_keys() - before

            push(1)
            assert leader_record(ctl, sender.epoch, HOST) == record  # the mates joined without taking over
            before, lead_before = mates_proxy.snapshot_keys(), lead_proxy.snapshot_keys()
            time.sleep(IDLE_S)  # the measuring window itself
            idle, lead_idle = mates_proxy.snapshot_keys() - before, lead_proxy.snapshot_keys() - lead_before
            per_push = [push(v) for v in (2, 3, 4)] + [push(6, after=5)]
            mates_ran_s = time.monotonic() - mates_launched
            for conn in (lead, mates):
                conn.send(("close",))
            for conn in (lead, mates):
                receive(conn, 30, "the receivers to close")

    # At idle the three host-mates ask the store nothing: their leader writes their heartbeats
    # (before: a compare_set each every 2 s, and before that polls of the leader's record, the
    # chain and news, ~35 requests/s each). One beat on the store, by a host-mate whose leader
    # was late on a loaded machine, is allowed.
    idle_own, idle_backstop = _split(idle)
    assert sum(idle_own.values()) <= 1, _keys(idle)
    # Per push neither: the leader writes their acknowledgements, and they learn of the version
    # from its board and ring (before: an acknowledgement each, and before that news and four
    # records, ~6 each), also when two versions came between two of its looks at the board.
    pushes = [_split(c) for c in per_push]
    assert sum(sum(own.values()) for own, _ in pushes) <= 2, [_keys(c) for c in per_push]
    # The timed backstops: one look (the sender pointer, the close, latest; at most 4 requests)
    # per host-mate per backstop period, with its relay member's read of the leader's record (at most 6
    # requests in all), and no more (before: every 0.1 s).
    backstops = [idle_backstop] + [b for _, b in pushes]
    looks = sum(b.get("sender/current", 0) for b in backstops)
    rounds = _backstop_rounds(mates_ran_s)
    assert looks <= rounds, (looks, rounds, mates_ran_s, backstops)
    assert sum(sum(b.values()) for b in backstops) <= 6 * rounds, (rounds, mates_ran_s, backstops)
    # The leader writes the host's beats (its own with them) in one multi_set per beat period, and
    # the host's acknowledgements in one per version (two when its own, at publish, and the
    # host-mates', after their copy, are more than 50 ms apart).
    lead_beats = _member_writes(lead_idle)
    assert lead_beats.get("multi_set", 0) <= IDLE_S / (HEARTBEAT_TIMEOUT_S / 4) + 1, _keys(lead_idle)
    assert sum(lead_beats.values()) - lead_beats.get("multi_set", 0) <= 1, _keys(lead_idle)
    acks = [sum(_member_writes(c).values()) for c in lead_pushes[1:]]  # (version 1 was acknowledged before)
    print("leader, member keys: idle", dict(lead_beats), "per push", acks)
    assert statistics.median(acks) <= 2 and max(acks) <= 3, [_keys(c) for c in lead_pushes]
    assert mates_proxy.unparsed == 0 and lead_proxy.unparsed == 0


def _member_writes(counts: Counter[str]) -> Counter[str]:
    """Requests on ``member/<rid>/hb`` and ``member/<rid>/state``, by command."""
    out: Counter[str] = Counter()
    for k, v in counts.items():
        if k.endswith(("member/#/hb", "member/#/state")):
            out[k.split()[0]] += v
    return out
