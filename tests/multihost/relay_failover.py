"""Scenario: a host leader SIGKILLed (or SIGSTOPped) mid-version while the trainer keeps pushing.

The trainer (this process, host 0) pushes versions one after another to R receivers on
each of H hosts, relayed host to host. While version ``kill_at`` is on the wire into
host 1 (its interface has received 40% of the bytes), host 1's leader is SIGKILLed, or
with mode ``stop`` SIGSTOPped (a stall longer than every timeout). Every later version
must reach every other receiver within ``timeout_s`` (push reports), a host-mate must
take over host 1, and every version any receiver applied must be bit-exact (digests
against the trainer's). With ``stop`` the stalled leader is then resumed and one more
version is pushed: it must reach every receiver, the resumed one included. An optional
seventh argument is the sender's ``cross_host`` (default ``relay``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from _scenario import Procs, main, wait_until

from lightning_wsync import WeightSender
from lightning_wsync._control.store import Control
from lightning_wsync._planes.relay.head.feed import leader_record
from lightning_wsync._planes.relay.hops import read_chain
from lightning_wsync.testing.hosts import SimHosts
from lightning_wsync.testing.models import build_model, digest, mutate, spec_for_size

HERE = Path(__file__).resolve().parent


def read(path: Path) -> list[dict[str, Any]]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if path.exists()
        else []
    )


def middle_host(ctl: Control, epoch: int, hosts: SimHosts, n_hosts: int) -> int:
    """The host whose leader is second in the relay's chain (waited for: every host's leader in it)."""

    def found() -> int | None:
        chain = read_chain(ctl, epoch)
        if chain is None or len(chain.rids) < n_hosts:
            return None
        by_rid = {}
        for h in range(1, n_hosts + 1):
            record = leader_record(ctl, epoch, hosts.name(h))
            if record is not None:
                by_rid[record.rid] = h
        return by_rid.get(chain.rids[1])

    return int(wait_until("every host's leader in the chain", found, 60))


def scenario(argv: list[str]) -> dict[str, Any]:
    out, n_hosts, per_host, size_mb, link = (
        Path(argv[0]),
        int(argv[1]),
        int(argv[2]),
        float(argv[3]),
        argv[4],
    )
    mode = argv[5] if len(argv) > 5 else "kill"
    cross_host = argv[6] if len(argv) > 6 else "relay"
    # "host1": host 1's leader, wherever it is in the chain; "middle": the chain's second leader
    # (its first then stays first: the head must not leave that one's version half-sent).
    victim = argv[7] if len(argv) > 7 else "host1"
    sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[mode]
    kill_at, pushes, timeout_s = 3, 7, 10.0
    events = out / "events.jsonl"
    with SimHosts(n_hosts + 1) as hosts:
        for i in range(hosts.n):
            hosts.shape(i, link)
        os.environ["WSYNC_HOST_ID"] = hosts.name(0)
        hosts.enter(0)
        model = build_model(spec_for_size(size_mb), seed=0)
        with WeightSender(model, store=f"{hosts.address(0)}:0", job="failover", timeout_s=timeout_s,
                          heartbeat_timeout_s=2.0, cross_host=cross_host) as sender:  # fmt: skip
            procs = Procs(hosts, out)
            names = [
                f"h{h}r{j}" for h in range(1, n_hosts + 1) for j in range(per_host)
            ]
            for name in names:
                argv_ = [sys.executable, str(HERE / "_relay_receiver.py"), "--store", str(sender.store_address),
                         "--job", "failover", "--name", name, "--size-mb", str(size_mb),
                         "--events", str(events)]  # fmt: skip
                procs.start(name, int(name[1 : name.index("r")]), argv_)
            wait_until(
                "every receiver to register",
                lambda: set(names) <= set(sender.receivers()),
                180,
                procs,
            )
            ctl = Control(sender.store, "failover")
            expected: dict[int, str] = {}
            reports: list[dict[str, Any]] = []
            killed: dict[str, Any] = {}
            for version in range(1, pushes + 1):
                mutate(model, version)
                expected[version] = digest(model, None)
                if version == kill_at:
                    host = 1 if victim == "host1" else middle_host(ctl, sender.epoch, hosts, n_hosts)
                    record = leader_record(ctl, sender.epoch, hosts.name(host))
                    assert record is not None, f"host {host} has no leader"
                    rx0 = hosts.counters(host)[1]
                    started = time.monotonic()
                    handle = sender.push(version)
                    goal = rx0 + 0.4 * sender.layout.total_bytes
                    wait_until(
                        f"40% of the version to reach host {host}",
                        lambda goal=goal, host=host: hosts.counters(host)[1] >= goal,
                        30,
                    )
                    os.kill(record.pid, sig)
                    killed = {"rid": record.rid, "pid": record.pid, "after_s": time.monotonic() - started,
                              "rx_bytes": hosts.counters(host)[1] - rx0, "host": host}  # fmt: skip
                else:
                    handle = sender.push(version)
                report = handle.wait(timeout_s)
                reports.append({"version": version, "delivered": sorted(report.delivered), "failed": report.failed,
                                "latency_s": report.latency_s})  # fmt: skip
            after = leader_record(ctl, sender.epoch, hosts.name(killed["host"]))
            ready = {r["pid"]: r for r in read(events) if r["event"] == "ready"}
            killed["name"] = (
                ready[killed["pid"]]["name"] if killed["pid"] in ready else None
            )
            latest = pushes
            resumed: dict[str, Any] = {}
            if mode == "stop":
                # The stalled leader comes back: it must step down and follow its host-mate.
                os.kill(int(str(killed["pid"])), signal.SIGCONT)
                latest = pushes + 1
                mutate(model, latest)
                expected[latest] = digest(model, None)
                report = sender.push(latest).wait(timeout_s)
                resumed = {"version": latest, "delivered": sorted(report.delivered), "failed": report.failed,
                           "latency_s": report.latency_s}  # fmt: skip

                def resumed_holds_latest() -> bool:
                    return any(r["event"] == "applied" and r["name"] == killed["name"] and r["version"] == latest
                               for r in read(events))  # fmt: skip

                wait_until(
                    "the resumed receiver to apply the version pushed after its stall",
                    resumed_holds_latest,
                    60,
                    procs,
                )

            def all_live_hold_latest() -> bool:
                got = {
                    r["name"]
                    for r in read(events)
                    if r["event"] == "applied" and r["version"] == latest
                }
                return got >= set(names) - {killed["name"]}

            wait_until(
                "every live receiver to apply the last version",
                all_live_hold_latest,
                timeout_s,
                procs,
            )
        applied = [r for r in read(events) if r["event"] == "applied"]
        return {
            "names": names,
            "reports": reports,
            "killed": killed,
            "leader_after": None
            if after is None
            else {"rid": after.rid, "pid": after.pid},
            "rids": {r["name"]: r["rid"] for r in ready.values()},
            "applied": [
                {
                    "name": r["name"],
                    "version": r["version"],
                    "exact": r["digest"] == expected.get(r["version"]),
                }
                for r in applied
            ],
            "kill_at": kill_at,
            "mode": mode,
            "resumed": resumed,
            "timeout_s": timeout_s,
        }


if __name__ == "__main__":
    main(scenario)
