"""How fast a fleet switches while the trainer pushes every few milliseconds.

    python examples/fleet/measure_fleet.py --members 2 --mb 16 --seconds 10

One sender (this process) pushes a model of ``--mb`` MiB every ``--every-ms``; ``--members``
receiver processes with ``fleet="bench"`` call ``update()`` in a loop. Prints JSON: switches
per second, push -> switch time (p50, p95: from ``push()`` of a version to the switch record
naming it, on the sender's clock), push() stall (max) and how many switches left anyone out.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from multiprocessing.connection import Connection

import torch
from torch import nn

from lightning_wsync import WeightReceiver, WeightSender
from lightning_wsync.testing.procs import Children, init_child, receive


def model(mb: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.ParameterList([nn.Parameter(torch.randn(256, 1024)) for _ in range(max(1, mb))])


def member(conn: Connection, store: str, name: str, mb: int) -> None:
    init_child()
    with WeightReceiver(model(mb), store=store, job="fleet-bench", name=name, fleet="bench") as receiver:
        conn.send(("ready",))
        while not conn.poll(0):
            receiver.update()  # a rollout loop's call between episodes
            time.sleep(0.001)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--members", type=int, default=2)
    p.add_argument("--mb", type=int, default=16)
    p.add_argument("--every-ms", type=float, default=5.0)
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = f"127.0.0.1:{port}"
    m = model(args.mb)
    pushed_at: dict[int, float] = {}
    stalls: list[float] = []
    switches = []
    with WeightSender(m, store=store, job="fleet-bench", timeout_s=5) as sender, Children() as kids:
        conns = [kids.start(member, (store, f"m{i}", args.mb), f"m{i}") for i in range(args.members)]
        for c in conns:
            receive(c, 60, "member ready")
        version, end = 0, time.monotonic() + args.seconds
        seen: set[int] = set()
        while time.monotonic() < end:
            version += 1
            with torch.no_grad():
                m[version % len(m)].add_(1.0)
            started = time.perf_counter()
            pushed_at[version] = time.time()
            sender.push(version)
            stalls.append(time.perf_counter() - started)
            for sw in sender.fleet_switches("bench"):
                if sw.round not in seen:
                    seen.add(sw.round)
                    switches.append(sw)
            time.sleep(args.every_ms / 1000)
        for c in conns:
            c.send("stop")
    lat = sorted(sw.at - pushed_at[sw.version] for sw in switches if sw.version in pushed_at)
    print(json.dumps({
        "members": args.members, "mb": args.mb, "pushes": version, "switches": len(switches),
        "switches_per_s": round(len(switches) / args.seconds, 1),
        "push_to_switch_p50_s": round(statistics.median(lat), 4) if lat else None,
        "push_to_switch_p95_s": round(lat[int(0.95 * (len(lat) - 1))], 4) if lat else None,
        "push_stall_max_s": round(max(stalls), 4),
        "switches_leaving_someone_out": sum(bool(sw.excluded) for sw in switches),
    }))


if __name__ == "__main__":
    main()
