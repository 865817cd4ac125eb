"""Scenario: deltas on every relay hop, through a corrupted delta, a late host and a leader failover.

The trainer (this process, host 0) makes each version by an AdamW step (lr 1e-6) of a
small GPT-shaped model and pushes it in bf16 with ``delta="always"``, relayed host to
host. Host 1 runs two receivers, host 2 one; host 2's receiver corrupts version 4 as it
rebuilds it; host 3's receiver starts late; host 1's leader is SIGKILLed
near the end. The scenario records every push report, how each host leader received
each version (the relay's receipts: delta or full, bytes on its hop) and every version
each receiver applied with its digest; the test judges them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from _scenario import Procs, leader_receipts, main, wait_until

from lightning_wsync import WeightSender
from lightning_wsync._control import keys
from lightning_wsync._control.store import Control
from lightning_wsync._planes.relay.head.feed import leader_record
from lightning_wsync.testing.hosts import SimHosts
from lightning_wsync.testing.models import ModelSpec, digest
from lightning_wsync.testing.steps import Trainer

HERE = Path(__file__).resolve().parent
SPEC = ModelSpec(d_model=256, vocab=4096, n_layers=2)  # 2.6M parameters: 5.3 MB in bf16, 6 buckets of 1 MiB
CORRUPT_AT = 4


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def scenario(argv: list[str]) -> dict[str, Any]:
    out = Path(argv[0])
    timeout_s = 5.0
    events = out / "events.jsonl"
    with SimHosts(4) as hosts:
        os.environ["WSYNC_HOST_ID"] = hosts.name(0)
        hosts.enter(0)
        trainer = Trainer(SPEC, lr=1e-6, seed=0)
        options: dict[str, Any] = {"dtype": "bfloat16", "bucket_mb": 1, "timeout_s": timeout_s,
                                   "heartbeat_timeout_s": 2.0, "delta": "always"}  # fmt: skip
        with WeightSender(trainer.model, store=f"{hosts.address(0)}:0", job="deltas", **options) as sender:
            ctl = Control(sender.store, "deltas")
            procs = Procs(hosts, out)

            def start(name: str) -> None:
                host = int(name[1 : name.index("r")])
                argv_ = [sys.executable, str(HERE / "_relay_receiver.py"), "--store", str(sender.store_address),
                         "--job", "deltas", "--name", name, "--size-mb", "1", "--events", str(events),
                         "--spec", f"{SPEC.d_model},{SPEC.vocab},{SPEC.n_layers}", "--wire-dtype", "bfloat16",
                         "--timeout-s", "30"]  # fmt: skip
                if host == 2:
                    argv_ += ["--corrupt-version", str(CORRUPT_AT)]
                procs.start(name, host, argv_)

            def leader(host: int) -> int | None:
                record = leader_record(ctl, sender.epoch, hosts.name(host))
                return None if record is None else record.rid

            def in_chain(hosts_: list[int]) -> bool:
                chain = ctl.get_json(keys.relay_chain(sender.epoch))
                rids = [leader(h) for h in hosts_]
                return chain is not None and None not in rids and set(rids) <= set(chain["rids"])

            def applied(names: set[str], version: int) -> bool:
                got = {r["name"] for r in read(events) if r["event"] == "applied" and r["version"] == version}
                return names <= got

            expected: dict[int, str] = {}
            reports: list[dict[str, Any]] = []
            receipts: dict[str, dict[str, Any]] = {}  # host -> version -> [delta, wire bytes, changed, decode s]

            def push(version: int, names: set[str], *, all_apply: bool = True) -> None:
                trainer.step()
                expected[version] = digest(trainer.model, torch.bfloat16)
                report = sender.push(version).wait(timeout_s)
                reports.append({"version": version, "delivered": sorted(report.delivered), "failed": report.failed,
                                "delta_receivers": sorted(report.delta_receivers), "delta_bytes": report.delta_bytes,
                                "bytes": report.bytes})  # fmt: skip
                if all_apply:
                    wait_until(f"{sorted(names)} to apply version {version}", lambda: applied(names, version),
                               60, procs)  # fmt: skip
                note_receipts(version, hosts=tuple(sorted({int(n[1 : n.index("r")]) for n in names})))

            def note_receipts(version: int, tag: str = "", hosts: tuple[int, ...] = (1, 2, 3)) -> None:
                rids = {f"{host}{tag}": leader(host) for host in hosts}
                for name, row in leader_receipts(ctl, sender.epoch, rids, version).items():
                    receipts.setdefault(name, {})[str(version)] = row

            names = {"h1r0", "h1r1", "h2r0"}
            for name in sorted(names):
                start(name)
            wait_until("every receiver to register", lambda: names <= set(sender.receivers()), 120, procs)
            wait_until("hosts 1 and 2 in the relay chain", lambda: in_chain([1, 2]), 60, procs)
            chain = ctl.get_json(keys.relay_chain(sender.epoch))
            order = [h for rid in chain["rids"] for h in (1, 2) if leader(h) == rid]  # hosts in chain order
            for version in (1, 2, 3):
                push(version, names)
            push(CORRUPT_AT, names - {"h2r0"}, all_apply=False)
            wait_until("host 1 to apply the corrupted version", lambda: applied({"h1r0", "h1r1"}, CORRUPT_AT), 60)
            for version in (5, 6):
                push(version, names)

            start("h3r0")  # a late host: the newest version in full, then deltas
            names.add("h3r0")
            wait_until("the late host to join the chain", lambda: in_chain([1, 2, 3]), 60, procs)
            wait_until("the late host to apply version 6", lambda: applied({"h3r0"}, 6), 60, procs)
            note_receipts(6)
            push(7, names)

            old = leader_record(ctl, sender.epoch, hosts.name(1))
            assert old is not None
            ready = {r["pid"]: r["name"] for r in read(events) if r["event"] == "ready"}
            killed = ready[old.pid]
            os.kill(old.pid, signal.SIGKILL)
            names.discard(killed)
            wait_until("a new leader on host 1", lambda: leader(1) not in (None, old.rid), 30, procs)
            wait_until("host 1's new leader in the chain", lambda: in_chain([1, 2, 3]), 60, procs)
            wait_until("host 1's new leader to apply version 7", lambda: applied(names, 7), 60, procs)
            wait_until("the sender to see the killed leader gone", lambda: killed not in sender.receivers(), 30)
            note_receipts(7, "'")  # host 1' is host 1 under its new leader
            for version in (8, 9):
                push(version, names)
        return {
            "reports": reports,
            "receipts": receipts,
            "killed": killed,
            "order": order,
            "full_bytes": sender.layout.total_bytes,
            "applied": [{"name": r["name"], "version": r["version"], "exact": r["digest"] == expected.get(r["version"])}
                        for r in read(events) if r["event"] == "applied"],  # fmt: skip
        }


if __name__ == "__main__":
    main(scenario)
