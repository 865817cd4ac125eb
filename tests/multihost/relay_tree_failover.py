"""Scenario: the relay's two trees, an inner leader SIGKILLed mid-version.

The trainer (this process, host 0) pushes versions to one receiver on each of H hosts
with ``cross_host="tree"``. While version ``kill_at`` is on the wire into the leader
that is inner in tree 0 below its root (its interface has received 40% of the bytes),
that leader is SIGKILLed. Its children in tree 0 (its subtree) must be re-attached: every
later version reaches every other receiver within ``timeout_s``, the trees are re-formed
without it, and every version any receiver applied is bit-exact.
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
from lightning_wsync._planes.relay.plan import tree_links
from lightning_wsync.testing.hosts import SimHosts
from lightning_wsync.testing.models import build_model, digest, mutate, spec_for_size

HERE = Path(__file__).resolve().parent


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def scenario(argv: list[str]) -> dict[str, Any]:
    out, n_hosts, size_mb, link = Path(argv[0]), int(argv[1]), float(argv[2]), argv[3]
    kill_at, pushes, timeout_s = 3, 6, 10.0
    events = out / "events.jsonl"
    with SimHosts(n_hosts + 1) as hosts:
        for i in range(hosts.n):
            hosts.shape(i, link)
        os.environ["WSYNC_HOST_ID"] = hosts.name(0)
        hosts.enter(0)
        model = build_model(spec_for_size(size_mb), seed=0)
        with WeightSender(model, store=f"{hosts.address(0)}:0", job="tree", timeout_s=timeout_s,
                          heartbeat_timeout_s=2.0, cross_host="tree") as sender:  # fmt: skip
            procs = Procs(hosts, out)
            names = [f"h{h}r0" for h in range(1, n_hosts + 1)]
            for h, name in enumerate(names, start=1):
                argv_ = [sys.executable, str(HERE / "_relay_receiver.py"), "--store", str(sender.store_address),
                         "--job", "tree", "--name", name, "--size-mb", str(size_mb),
                         "--events", str(events)]  # fmt: skip
                procs.start(name, h, argv_)
            wait_until("every receiver to register", lambda: set(names) <= set(sender.receivers()), 180, procs)
            ctl = Control(sender.store, "tree")
            leaders = {}  # rid -> host index

            def every_host_in_the_trees() -> bool:
                for h in range(1, n_hosts + 1):
                    record = leader_record(ctl, sender.epoch, hosts.name(h))
                    if record is not None:
                        leaders[record.rid] = h
                chain = read_chain(ctl, sender.epoch)
                return chain is not None and chain.tree and set(chain.rids) == set(leaders) and len(leaders) == n_hosts

            expected: dict[int, str] = {}
            reports: list[dict[str, Any]] = []
            killed: dict[str, Any] = {}
            tx: list[int] = []  # the trainer's egress counter at each push's start, then at the end
            for version in range(1, pushes + 1):
                tx.append(hosts.counters(0)[0])
                mutate(model, version)
                expected[version] = digest(model, None)
                if version == kill_at:
                    wait_until("the trees to hold every host", every_host_in_the_trees, 60, procs)
                    before = read_chain(ctl, sender.epoch)
                    assert before is not None
                    victim = before.rids[1]  # inner in tree 0, below its root
                    subtree = list(tree_links(before.rids, victim).children[0])
                    host = leaders[victim]
                    record = leader_record(ctl, sender.epoch, hosts.name(host))
                    assert record is not None and record.rid == victim
                    rx0 = hosts.counters(host)[1]
                    started = time.monotonic()
                    handle = sender.push(version)
                    goal = rx0 + 0.4 * sender.layout.total_bytes
                    wait_until("40% of the version to reach the victim",
                               lambda host=host, goal=goal: hosts.counters(host)[1] >= goal, 30)  # fmt: skip
                    os.kill(record.pid, signal.SIGKILL)
                    killed = {"rid": victim, "host": host, "name": f"h{host}r0", "after_s": time.monotonic() - started,
                              "rx_bytes": hosts.counters(host)[1] - rx0, "before": list(before.rids),
                              "subtree": [f"h{leaders[r]}r0" for r in subtree]}  # fmt: skip
                else:
                    handle = sender.push(version)
                report = handle.wait(timeout_s)
                reports.append({"version": version, "delivered": sorted(report.delivered), "failed": report.failed,
                                "latency_s": report.latency_s})  # fmt: skip
            tx.append(hosts.counters(0)[0])
            for entry, (a, b) in zip(reports, zip(tx, tx[1:])):
                entry["egress_models"] = round((b - a) / sender.layout.total_bytes, 3)
            after = read_chain(ctl, sender.epoch)

            def all_live_hold_latest() -> bool:
                got = {r["name"] for r in read(events) if r["event"] == "applied" and r["version"] == pushes}
                return got >= set(names) - {killed["name"]}

            wait_until("every live receiver to apply the last version", all_live_hold_latest, timeout_s, procs)
            crashed = procs.crashed()
        applied = [r for r in read(events) if r["event"] == "applied"]
        return {
            "names": names, "reports": reports, "killed": killed, "kill_at": kill_at, "timeout_s": timeout_s,
            "crashed": crashed,
            "after": None if after is None else {"number": after.number, "rids": list(after.rids), "tree": after.tree},
            "applied": [{"name": r["name"], "version": r["version"], "exact": r["digest"] == expected.get(r["version"])}
                        for r in applied],
        }  # fmt: skip


if __name__ == "__main__":
    main(scenario)
