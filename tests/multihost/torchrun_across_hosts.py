"""Scenario: a trainer job on one simulated host, a 2-node rollout job on two others.

Every job is a real ``torchrun --rdzv-backend=wsync`` agent with ``--local-addr`` set to
its host's address; the rollout job's two agents form one elastic group across hosts
(its workers all-reduce over gloo on ``eth0``) and every worker receives the trainer's
versions over the network (different ``WSYNC_HOST_ID``). Reuses the rendezvous tests'
scripts, which check each applied version bit-exact against the trainer's weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from _scenario import Procs, main, wait_until

from lightning_wsync.testing.hosts import SimHosts

SCRIPTS = Path(__file__).resolve().parents[1] / "rendezvous" / "scripts"
PORT = 29400  # a fresh network namespace: nothing else listens here


def read_events(out: Path) -> list[dict[str, Any]]:
    path = out / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def scenario(argv: list[str]) -> dict[str, Any]:
    out = Path(argv[0])
    with SimHosts(3) as hosts:
        procs = Procs(hosts, out)
        endpoint = f"{hosts.address(0)}:{PORT}"

        def torchrun(
            name: str,
            host: int,
            nnodes: str,
            nproc: int,
            conf: str,
            script: str,
            *args: str,
        ) -> None:
            env = hosts.env(host)
            env.pop(
                "WSYNC_ADDR"
            )  # as on real hosts: the address is found from the route to the store
            env["GLOO_SOCKET_IFNAME"] = (
                "eth0"  # the jobs' own gloo groups (torchrun's default group)
            )
            argv_ = [
                sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
                "--rdzv-backend=wsync", f"--rdzv-endpoint={endpoint}", "--rdzv-id=exp1", f"--rdzv-conf={conf}",
                f"--local-addr={hosts.address(host)}", "--max-restarts=0", "--monitor-interval=0.1",
                str(SCRIPTS / script), "--out", str(out), *args,
            ]  # fmt: skip
            procs.start(name, host, argv_, env=env)

        stop = out / "stop-trainer"
        torchrun(
            "trainer", 0, "1", 1, "role=trainer", "trainer_job.py", "--stop", str(stop)
        )
        for host in (1, 2):
            torchrun(
                f"rollout-h{host}",
                host,
                "2",
                2,
                "role=rollout",
                "rollout_job.py",
                "--tag",
                f"h{host}",
                "--pg",
            )

        def applied_everywhere() -> bool:
            rs = read_events(out)
            return (
                len(
                    {
                        r["pid"]
                        for r in rs
                        if r["event"] == "applied" and r["version"] >= 2
                    }
                )
                == 4
            )

        wait_until(
            "all 4 rollout workers to apply version 2 or newer",
            applied_everywhere,
            150,
            procs,
        )
        stop.touch()
        for name in ("trainer", "rollout-h1", "rollout-h2"):
            rc = procs.wait(name, 90)
            assert rc == 0, f"{name} exited {rc}\n{procs.describe()}"
        events = read_events(out)
        return {
            "starts": [r for r in events if r["event"] == "start"],
            "pg": [r for r in events if r["event"] == "pg"],
            "applied": [r for r in events if r["event"] == "applied"],
            "final": [r for r in events if r["event"] == "final"],
            "pushes": [r["version"] for r in events if r["event"] == "push"],
            "addresses": [hosts.address(i) for i in range(3)],
        }


if __name__ == "__main__":
    main(scenario)
