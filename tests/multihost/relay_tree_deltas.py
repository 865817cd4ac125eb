"""Scenario: deltas on the edges of the relay's two trees, through an inner leader SIGKILLed mid-version
and a host restarted.

The trainer (this process, host 0) makes each version by an AdamW step (lr 1e-6) of a
small GPT-shaped model and pushes it in bf16 with ``delta="always"`` and
``cross_host="tree"`` to one receiver on each of H hosts. Version ``KILL_AT`` changes every
weight (its delta is as large as the version), and while it is on the wire into the leader
that is inner in tree 0 below its root (40% of the bytes in), that leader is SIGKILLed.
Later a receiver is started again on the killed leader's host (a restarted host). The
scenario records every push report, the trainer's veth tx bytes per push, how each leader
got each version (the relay's receipts) and every version each receiver applied with its
digest; the test judges them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _scenario import Procs, leader_receipts, main, wait_until

from lightning_wsync import WeightSender
from lightning_wsync._control.store import Control
from lightning_wsync._planes.relay.head.feed import leader_record
from lightning_wsync._planes.relay.hops import read_chain
from lightning_wsync._planes.relay.plan import tree_links
from lightning_wsync.testing.hosts import SimHosts
from lightning_wsync.testing.models import ModelSpec, digest, mutate
from lightning_wsync.testing.steps import Trainer

HERE = Path(__file__).resolve().parent
SPEC = ModelSpec(d_model=256, vocab=4096, n_layers=2)  # 2.6M parameters: 5.3 MB in bf16
KILL_AT = 4
LAST = 7


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def scenario(argv: list[str]) -> dict[str, Any]:
    out, n_hosts, link = Path(argv[0]), int(argv[1]), argv[2]
    timeout_s = 10.0
    events = out / "events.jsonl"
    with SimHosts(n_hosts + 1) as hosts:
        for i in range(hosts.n):
            hosts.shape(i, link)
        os.environ["WSYNC_HOST_ID"] = hosts.name(0)
        hosts.enter(0)
        trainer = Trainer(SPEC, lr=1e-6, seed=0)
        options: dict[str, Any] = {"dtype": "bfloat16", "bucket_mb": 1, "timeout_s": timeout_s,
                                   "heartbeat_timeout_s": 2.0, "delta": "always", "cross_host": "tree"}  # fmt: skip
        with WeightSender(trainer.model, store=f"{hosts.address(0)}:0", job="tdelta", **options) as sender:
            ctl = Control(sender.store, "tdelta")
            procs = Procs(hosts, out)
            leaders: dict[int, int] = {}  # rid -> host

            def start(name: str, host: int) -> None:
                argv_ = [sys.executable, str(HERE / "_relay_receiver.py"), "--store", str(sender.store_address),
                         "--job", "tdelta", "--name", name, "--size-mb", "1", "--events", str(events),
                         "--spec", f"{SPEC.d_model},{SPEC.vocab},{SPEC.n_layers}", "--wire-dtype", "bfloat16",
                         "--timeout-s", "30"]  # fmt: skip
                procs.start(name, host, argv_)

            def leader(host: int) -> int | None:
                record = leader_record(ctl, sender.epoch, hosts.name(host))
                return None if record is None else record.rid

            def trees_hold(hosts_: list[int]) -> bool:
                rids = [leader(h) for h in hosts_]
                chain = read_chain(ctl, sender.epoch)
                leaders.update({r: h for r, h in zip(rids, hosts_) if r is not None})
                return chain is not None and chain.tree and None not in rids and set(rids) == set(chain.rids)

            def applied(names: set[str], version: int) -> bool:
                got = {r["name"] for r in read(events) if r["event"] == "applied" and r["version"] == version}
                return names <= got

            expected: dict[int, str] = {}
            reports: list[dict[str, Any]] = []
            receipts: dict[str, dict[str, Any]] = {}  # receiver name -> version -> [delta, wire bytes, changed, s]
            names = {f"h{h}r0": h for h in range(1, n_hosts + 1)}

            def note_receipts(version: int) -> None:
                rids = {name: leader(host) for name, host in names.items()}
                for name, row in leader_receipts(ctl, sender.epoch, rids, version).items():
                    receipts.setdefault(name, {})[str(version)] = row

            def push(version: int, *, wait: bool = True) -> None:
                tx0 = hosts.counters(0)[0]
                report = sender.push(version).wait(timeout_s)
                reports.append({"version": version, "delivered": sorted(report.delivered), "failed": report.failed,
                                "latency_s": report.latency_s, "delta_receivers": sorted(report.delta_receivers),
                                "delta_bytes": report.delta_bytes, "tx_bytes": hosts.counters(0)[0] - tx0})  # fmt: skip
                if wait:
                    wait_until(f"every live receiver to apply version {version}",
                               lambda: applied(set(names), version), 60, procs)  # fmt: skip
                note_receipts(version)

            for name, host in names.items():
                start(name, host)
            wait_until("every receiver to register", lambda: set(names) <= set(sender.receivers()), 180, procs)
            wait_until("the trees to hold every host", lambda: trees_hold(list(names.values())), 60, procs)
            for version in range(1, KILL_AT):
                trainer.step()
                expected[version] = digest(trainer.model, torch.bfloat16)
                push(version)

            before = read_chain(ctl, sender.epoch)
            assert before is not None
            victim = before.rids[1]  # inner in tree 0, below its root
            host = leaders[victim]
            record = leader_record(ctl, sender.epoch, hosts.name(host))
            assert record is not None and record.rid == victim
            subtree = [f"h{leaders[r]}r0" for r in tree_links(before.rids, victim).children[0]]
            mutate(trainer.model, KILL_AT)  # every word changes: the delta is as large as the version
            expected[KILL_AT] = digest(trainer.model, torch.bfloat16)
            rx0 = hosts.counters(host)[1]
            started = time.monotonic()
            handle = sender.push(KILL_AT)
            goal = rx0 + 0.4 * sender.layout.total_bytes
            wait_until("40% of the version to reach the victim", lambda: hosts.counters(host)[1] >= goal, 30)
            os.kill(record.pid, signal.SIGKILL)
            killed_name = f"h{host}r0"
            killed = {"rid": victim, "host": host, "name": killed_name, "after_s": time.monotonic() - started,
                      "rx_bytes": hosts.counters(host)[1] - rx0, "subtree": subtree}  # fmt: skip
            del names[killed_name]
            report = handle.wait(timeout_s)
            reports.append({"version": KILL_AT, "delivered": sorted(report.delivered), "failed": report.failed,
                            "latency_s": report.latency_s})  # fmt: skip
            wait_until(f"every live receiver to apply version {KILL_AT}", lambda: applied(set(names), KILL_AT), 60,
                       procs)  # fmt: skip
            note_receipts(KILL_AT)
            for version in range(KILL_AT + 1, LAST):
                trainer.step()
                expected[version] = digest(trainer.model, torch.bfloat16)
                push(version)
            after = read_chain(ctl, sender.epoch)

            restarted = f"h{host}r1"  # the killed leader's host, restarted: the newest version at once, in full
            start(restarted, host)
            names[restarted] = host
            wait_until("the restarted host in the trees", lambda: trees_hold(sorted(set(names.values()))), 60, procs)
            wait_until("the restarted host to apply the newest version", lambda: applied({restarted}, LAST - 1), 60,
                       procs)  # fmt: skip
            note_receipts(LAST - 1)
            trainer.step()
            expected[LAST] = digest(trainer.model, torch.bfloat16)
            push(LAST)
        return {
            "names": sorted(names), "killed": killed, "restarted": restarted, "reports": reports,
            "receipts": receipts, "full_bytes": sender.layout.total_bytes, "timeout_s": timeout_s,
            "after": None if after is None else {"rids": list(after.rids), "tree": after.tree},
            "applied": [{"name": r["name"], "version": r["version"], "exact": r["digest"] == expected.get(r["version"])}
                        for r in read(events) if r["event"] == "applied"],
        }  # fmt: skip


if __name__ == "__main__":
    main(scenario)
