"""``lightning-wsync bench --store-load``: control-plane requests at idle and per push.

::

    lightning-wsync bench --store-load --receivers 2 --store-hosts 4 --receivers-per-host 2
    lightning-wsync bench --store-load --store-hosts 8 --receivers-per-host 4 --cross-host relay --json

The bench hosts a TCPStore and puts a counting proxy (:mod:`lightning_wsync.testing.storeproxy`) in front of it;
the sender (this process) and every receiver reach the store only through the proxy, so
every request of every client is counted, by command. ``--receivers`` same-host receivers
run one process each (shared memory); ``--store-hosts`` simulated hosts each run one
process holding ``--receivers-per-host`` real receivers under that host's identity
(``WSYNC_HOST_ID``) on loopback, so they take the network path (``--cross-host``: a link
per receiver, or the relay) without network namespaces or root. The model is small: the
figure is the store's load, not the bytes.

It reports requests per second over an ``--idle-s`` window after a first version was
applied everywhere, then the requests counted during each of ``--pushes`` pushes (from
``push()`` until every receiver applied it, bit-exact), raw and less the idle rate over the
push's duration. With ``--capacity-clients C`` it also measures what one TCPStore on this
machine serves: C processes each sending back-to-back reads straight to the store.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import NamedTuple

import torch.distributed as dist
from torch import nn

from lightning_wsync import WeightSender
from lightning_wsync.bench._push import wait_registered
from lightning_wsync.testing.hostproc import HostArgs, host_main
from lightning_wsync.testing.models import build_model, digest, mutate, spec_for_size
from lightning_wsync.testing.procs import Children, init_child, receive
from lightning_wsync.testing.storeproxy import CountingProxy
from lightning_wsync.testing.stores import host_store

_STORE_HOST = "127.0.0.1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store-load", action="store_true",
                        help="count control-plane store requests at idle and per push (see --store-hosts)")
    parser.add_argument("--store-hosts", type=int, default=4,
                        help="with --store-load: simulated hosts on loopback, --receivers-per-host each (default 4)")
    parser.add_argument("--cross-host", choices=("star", "relay"), default="relay",
                        help="with --store-load: the sender's cross_host= (default relay)")
    parser.add_argument("--idle-s", type=float, default=5.0, help="with --store-load: idle window (default 5)")
    parser.add_argument("--capacity-clients", type=int, default=0,
                        help="with --store-load: also measure one TCPStore's capacity with this many clients")


def validate(args: argparse.Namespace) -> None:
    if args.store_hosts < 0:
        raise ValueError(f"--store-hosts={args.store_hosts!r} must be >= 0, e.g. --store-hosts 4")
    if not args.idle_s > 0:
        raise ValueError(f"--idle-s={args.idle_s!r} must be > 0, e.g. --idle-s 5")
    if args.capacity_clients < 0:
        raise ValueError(f"--capacity-clients={args.capacity_clients!r} must be >= 0, e.g. --capacity-clients 8")


def _hammer(conn: Connection, address: str, seconds: float) -> None:
    """One capacity client: back-to-back reads (the request a poll sends) for ``seconds``."""
    init_child()
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    conn.send(("ready", os.getpid()))
    receive(conn, 60, "go")
    n, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        store.compare_set("wsync-capacity-probe", "\x00", "\x00")
        n += 1
    conn.send(("done", n))


def measure_capacity(children: Children, address: str, clients: int, seconds: float = 3.0) -> float:
    """Requests per second one TCPStore serves to ``clients`` processes reading back to back."""
    conns = [children.start(_hammer, (address, seconds), name=f"wsync-bench-hammer{i}") for i in range(clients)]
    for conn in conns:
        receive(conn, 120, "a capacity client to start")
    for conn in conns:
        conn.send(("go",))
    return sum(int(str(receive(conn, seconds + 60, "a capacity count")[1])) for conn in conns) / seconds


def _rates(counts: Counter[str], seconds: float) -> dict[str, float]:
    return {k: round(v / seconds, 1) for k, v in sorted(counts.items())}


class _Run(NamedTuple):
    proxy: CountingProxy
    sender: WeightSender
    model: nn.Module
    conns: dict[str, Connection]
    timeout_s: float
    bad: list[str]  # receivers that applied other bytes than pushed
    idle_keys: Counter[str]  # requests in the idle window by command and key pattern
    push_keys: list[Counter[str]]  # requests of each push by command and key pattern

    def push(self, version: int) -> tuple[Counter[str], float]:
        """Push ``version`` and wait until every receiver applied it: the requests meanwhile, and the time."""
        mutate(self.model, version)
        expected = digest(self.model)
        before, started = self.proxy.snapshot(), time.monotonic()
        before_keys = self.proxy.snapshot_keys()
        self.sender.push(version)
        for conn in self.conns.values():
            conn.send(("await", version))
        for g, conn in self.conns.items():
            got = receive(conn, self.timeout_s, f"version {version} applied on {g}")
            self.bad.extend(f"{g}: version {version}" for d in got[2] if d != expected)  # type: ignore[attr-defined]
        took = time.monotonic() - started
        self.push_keys.append(self.proxy.snapshot_keys() - before_keys)
        return self.proxy.snapshot() - before, took


def _measure(run: _Run, args: argparse.Namespace) -> tuple[Counter[str], list[dict[str, object]]]:
    """Version 1, the idle window, then the timed pushes."""
    run.push(1)
    before, before_keys = run.proxy.snapshot(), run.proxy.snapshot_keys()
    time.sleep(args.idle_s)  # the measuring window itself, not a wait for anything
    idle = run.proxy.snapshot() - before
    run.idle_keys.update(run.proxy.snapshot_keys() - before_keys)
    idle_rate = sum(idle.values()) / args.idle_s
    pushes: list[dict[str, object]] = []
    for version in range(2, args.pushes + 2):
        counts, took = run.push(version)
        total = sum(counts.values())
        less_idle = round(total - idle_rate * took, 1)
        pushes.append({"version": version, "requests": total, "duration_s": round(took, 4),
                       "requests_less_idle": less_idle, "by_command": dict(counts)})  # fmt: skip
    return idle, pushes


def run_store_load(args: argparse.Namespace) -> dict[str, object]:
    """Run the idle window and the pushes; return the JSON-able result."""
    spec = spec_for_size(args.size_mb)
    model = build_model(spec, seed=args.seed)
    job = f"bench-store-{os.getpid()}-{time.monotonic_ns()}"
    server = host_store(_STORE_HOST, 0, timeout_s=args.timeout_s, multi_tenant=True)
    groups: dict[str, tuple[str | None, list[str]]] = {f"same{i}": (None, [f"same{i}"]) for i in range(args.receivers)}
    for h in range(args.store_hosts):
        groups[f"host{h}"] = (f"simhost-{h}", [f"h{h}r{i}" for i in range(args.receivers_per_host)])
    n_receivers = sum(len(names) for _, names in groups.values())
    result: dict[str, object] = {
        "config": {"receivers_same_host": args.receivers, "hosts": args.store_hosts,
                   "receivers_per_host": args.receivers_per_host, "cross_host": args.cross_host,
                   "receivers": n_receivers, "size_mb": args.size_mb, "idle_s": args.idle_s},
    }  # fmt: skip
    with CountingProxy(_STORE_HOST, server.port) as proxy, Children() as children:
        sender = WeightSender(model, store=proxy.address, job=job, cross_host=args.cross_host,
                              timeout_s=args.timeout_s)  # fmt: skip
        try:
            conns = {g: children.start(host_main, (HostArgs(proxy.address, job, names, host, spec, args.timeout_s),),
                                       name=f"wsync-bench-{g}") for g, (host, names) in groups.items()}  # fmt: skip
            startup_s = args.timeout_s * max(1.0, len(conns) / 4)
            for g, conn in conns.items():
                receive(conn, startup_s, f"receivers of {g} to start")
            wait_registered(sender, [n for _, names in groups.values() for n in names], startup_s)
            run = _Run(proxy, sender, model, conns, args.timeout_s, [], Counter(), [])
            idle, pushes = _measure(run, args)
            for conn in conns.values():
                conn.send(("close",))
        finally:
            sender.close()
        for g, conn in conns.items():
            receive(conn, args.timeout_s, f"receivers of {g} to close")
        if args.capacity_clients:
            result["capacity_requests_per_s"] = round(measure_capacity(children, f"{_STORE_HOST}:{server.port}",
                                                                       args.capacity_clients))  # fmt: skip
        result["unparsed_connections"] = proxy.unparsed
    for push, keyed in zip(pushes, run.push_keys[1:]):
        push["by_key"] = dict(sorted(keyed.items()))
    summary = _summary(idle, run.idle_keys, pushes, args, n_receivers)
    return {**result, **summary, "ok": not run.bad, "problems": run.bad}


def _summary(
    idle: Counter[str], idle_keys: Counter[str], pushes: list[dict[str, object]], args: argparse.Namespace,
    n_receivers: int,
) -> dict[str, object]:
    hosts = args.store_hosts + 1  # the trainer's host too
    idle_rate = sum(idle.values()) / args.idle_s
    median = round(statistics.median(float(str(p["requests_less_idle"])) for p in pushes), 1)
    return {
        "idle": {"requests_per_s": round(idle_rate, 1), "per_receiver_per_s": round(idle_rate / n_receivers, 2),
                 "per_host_per_s": round(idle_rate / hosts, 2), "by_command_per_s": _rates(idle, args.idle_s),
                 "by_key_per_s": _rates(idle_keys, args.idle_s)},
        "per_push": {"median_requests_less_idle": median, "per_receiver": round(median / n_receivers, 2),
                     "per_host": round(median / hosts, 2), "pushes": pushes},
    }  # fmt: skip


def format_store_load(result: dict[str, object]) -> str:
    cfg, idle, per_push = result["config"], result["idle"], result["per_push"]
    assert isinstance(cfg, dict) and isinstance(idle, dict) and isinstance(per_push, dict)
    lines = [
        f"store load: {cfg['receivers']} receivers ({cfg['receivers_same_host']} on the trainer's host, "
        f"{cfg['hosts']} hosts x {cfg['receivers_per_host']}, cross_host={cfg['cross_host']})",
        f"  idle: {idle['requests_per_s']} requests/s ({idle['per_receiver_per_s']}/receiver, "
        f"{idle['per_host_per_s']}/host)  by command: {idle['by_command_per_s']}",
        f"  per push (less idle, median of {len(per_push['pushes'])}): {per_push['median_requests_less_idle']} "
        f"({per_push['per_receiver']}/receiver, {per_push['per_host']}/host)",
    ]
    if "capacity_requests_per_s" in result:
        lines.append(f"  one TCPStore serves: {result['capacity_requests_per_s']} requests/s")
    if result["problems"]:
        lines.append(f"  NOT bit-exact: {result['problems']}")
    return "\n".join(lines)
