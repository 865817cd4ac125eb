"""Scenario: relay hops that connect after a version went by (a chain re-formed under load).

Three rollout hosts, one receiver each; every leader connects its hop downstream 1.5 s
late and does not wait for it, so the first version after each chain change goes by
while the hops behind the first leader are still connecting. Each version must still
reach every host (the leader resends what it holds once its hop is up), bit-exact,
without a further push. Versions are pushed one at a time, each waited for.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from _scenario import Procs, main, wait_until

from lightning_wsync import WeightSender
from lightning_wsync._control import keys
from lightning_wsync._control.store import Control
from lightning_wsync._planes.relay.head.feed import leader_record
from lightning_wsync.testing.hosts import SimHosts
from lightning_wsync.testing.models import build_model, digest, mutate, spec_for_size

HERE = Path(__file__).resolve().parent
SIZE_MB = 4


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def scenario(argv: list[str]) -> dict[str, Any]:
    out = Path(argv[0])
    events = out / "events.jsonl"
    with SimHosts(4) as hosts:
        os.environ["WSYNC_HOST_ID"] = hosts.name(0)
        hosts.enter(0)
        model = build_model(spec_for_size(SIZE_MB), seed=0)
        with WeightSender(model, store=f"{hosts.address(0)}:0", job="slow", timeout_s=10.0, bucket_mb=1,
                          heartbeat_timeout_s=3.0) as sender:  # fmt: skip
            ctl = Control(sender.store, "slow")
            procs = Procs(hosts, out)
            names = {"h1r0", "h2r0", "h3r0"}
            for name in sorted(names):
                procs.start(name, int(name[1]), [
                    sys.executable, str(HERE / "_relay_receiver.py"), "--store", str(sender.store_address),
                    "--job", "slow", "--name", name, "--size-mb", str(SIZE_MB), "--events", str(events),
                    "--timeout-s", "60", "--slow-connect-s", "1.5"])  # fmt: skip

            def chain_complete() -> bool:
                chain = ctl.get_json(keys.relay_chain(sender.epoch))
                rids = [leader_record(ctl, sender.epoch, hosts.name(h)) for h in (1, 2, 3)]
                return chain is not None and None not in rids and {r.rid for r in rids if r} <= set(
                    chain["rids"]
                )

            def applied(version: int) -> bool:
                got = {r["name"] for r in read(events) if r["event"] == "applied" and r["version"] == version}
                return names <= got

            wait_until("every receiver to register", lambda: names <= set(sender.receivers()), 120, procs)
            wait_until("all three hosts in the relay chain", chain_complete, 60, procs)
            expected: dict[int, str] = {}
            for version in (1, 2, 3):
                mutate(model, version)
                expected[version] = digest(model, None)
                sender.push(version)
                # One hop's late connection (1.5 s) plus the resend: well inside this bound, while
                # without the resend the version never reaches the hosts behind the first leader.
                wait_until(f"every host to apply version {version}", lambda v=version: applied(v), 30, procs)
        return {
            "applied": [{"name": r["name"], "version": r["version"], "exact": r["digest"] == expected.get(r["version"])}
                        for r in read(events) if r["event"] == "applied"],  # fmt: skip
        }


if __name__ == "__main__":
    main(scenario)
