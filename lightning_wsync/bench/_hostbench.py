"""``lightning-wsync bench --hosts H``: pushes across simulated hosts on shaped links.

::

    lightning-wsync bench --hosts 8 --receivers-per-host 2 --link 700mbit --size-mb 64
    lightning-wsync bench --hosts 2 --receivers-per-host 1 --link 700mbit --delta --dtype bfloat16  # see _hostdelta

The trainer (this process) runs on host 0; ``H`` rollout hosts each run ``R`` receiver
processes. Every host's link is shaped both ways to ``--link`` with ``tc tbf`` (which
delivers ~96% of the configured rate). The command re-runs itself as PID 1 of a fresh
network, mount and PID namespace (``unshare``, root only; see ``_hosts``), so the hosts,
links and processes it builds cannot outlive it.

Per push it measures the latency (``push()`` until the last receiver applied it) and the
trainer's egress (bytes its ``eth0`` sent, from the interface counters, in model copies),
against the wire bound (model bytes at the link rate: no design that sends every byte
into every host can beat it); ``per_hop_overhead_s`` is what is left of the latency after
the trainer's own NIC time (egress at the link rate), divided by the hops a version
travels (1 for the star). CPU per push is every process's (user and kernel) from ``push()``
until the last receiver applied it: the model's change before and the digests of the
bit-exact check after are the bench's work, left out (``cpu_s_with_bench`` has them). A
reference run to one rollout host (same R, same links) gives the "latency to one host"
the scale-out figures are judged against.

Longer than 300 lines: the relay/star phases and the per-transport phases (--transport) share one phase runner.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import torch

from lightning_wsync.bench import _hostdelta
from lightning_wsync.bench._push import PushRun
from lightning_wsync.bench._rawhop import raw_hop, session_cpu_s
from lightning_wsync.bench._receivers import Placement
from lightning_wsync.errors import WeightSyncError
from lightning_wsync.testing.hosts import (
    SimHosts,
    assume_host,
    in_session,
    isolated_argv,
    missing_requirements,
    prepare_session,
)
from lightning_wsync.testing.models import ModelSpec, build_model, spec_for_size
from lightning_wsync.testing.procs import BenchError
from lightning_wsync.testing.pushmodel import prefer_tree, tree_depth
from lightning_wsync.testing.storeproxy import CountingProxy

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_TOPOLOGIES = ("relay", "star")  # measured when --topology is not given
_CHOICES = ("relay", "chain", "tree", "star")  # relay: a chain or the trees, as the push-time model picks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", type=int, default=None,
                        help="rollout hosts simulated with network namespaces (root); "
                             "enables the multi-host bench")  # fmt: skip
    parser.add_argument("--receivers-per-host", type=int, default=2, help="receivers on each rollout host (default 2)")
    parser.add_argument("--link", default="700mbit", help="link rate of every host, tc syntax (default 700mbit)")
    parser.add_argument("--topology", choices=_CHOICES, action="append", default=None,
                        help="data plane(s) to measure across hosts, in turn: relay (chain or trees as the "
                             "model picks), chain, tree, star (default: relay and star; with --delta, each "
                             "full against deltas, default relay)")  # fmt: skip
    parser.add_argument("--no-reference", action="store_true", help="skip the one-host reference run")
    parser.add_argument("--rounds", type=int, default=None,
                        help="with --transport: measure every transport and topology in turn this many times "
                             "(alternating; medians and the spread; default 3 with two transports)")  # fmt: skip


def link_bits_per_s(rate: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", rate.strip().lower())
    if match is None:
        raise ValueError(f"--link={rate!r} is not a tc rate like '700mbit' or '1gbit'")
    return float(match.group(1)) * _UNITS[match.group(2)]


def validate(args: argparse.Namespace) -> None:
    if args.hosts < 1 or args.hosts > 64:
        raise ValueError(f"--hosts={args.hosts!r} must be in 1..64 (one namespace per host on this machine)")
    if args.receivers_per_host < 1:
        raise ValueError(f"--receivers-per-host={args.receivers_per_host!r} must be >= 1")
    link_bits_per_s(args.link)
    if args.transports != ["auto"] and not set(args.transports) <= {"gloo", "nixl"}:
        raise ValueError(f"--transport {args.transports!r} with --hosts: give gloo and/or nixl (each measured in "
                         f"turn, star) or none (the relay and the star over gloo)")  # fmt: skip
    if args.transports != ["auto"] and not set(args.topology or ()) <= {"star", "chain"}:
        raise ValueError(f"--topology {args.topology!r} with --transport: give star and/or chain (NIXL hops "
                         f"form chains only)")  # fmt: skip
    if args.rounds is not None and args.rounds < 1:
        raise ValueError(f"--rounds={args.rounds!r} must be >= 1")


def run(args: argparse.Namespace) -> int:
    """Entry point for ``bench --hosts``: re-run inside an isolated session, or measure there."""
    if not in_session():
        reason = missing_requirements()
        if reason is not None:
            print(f"lightning-wsync bench: --hosts: {reason}", file=sys.stderr)
            return 2
        return _run_isolated(args)
    prepare_session()
    try:
        result = measure(args)
    except (BenchError, WeightSyncError, OSError, RuntimeError) as exc:
        print(f"lightning-wsync bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    table = _hostdelta.format_table(result) if args.delta else format_table(result)
    print(json.dumps(result, indent=2) if args.json else table, flush=True)
    return 0 if result["ok"] else 1


def _run_isolated(args: argparse.Namespace) -> int:
    argv = [sys.executable, "-m", "lightning_wsync.cli", "bench", "--hosts", str(args.hosts),
            "--receivers-per-host", str(args.receivers_per_host), "--link", args.link,
            "--pushes", str(args.pushes), "--timeout-s", str(args.timeout_s),
            "--bucket-mb", str(args.bucket_mb), "--seed", str(args.seed)]  # fmt: skip
    if args.size_mb is not None:
        argv += ["--size-mb", str(args.size_mb)]
    if args.delta:
        argv += ["--delta", "--lr", str(args.lr), "--delta-mode", args.delta_mode]
    for topology in args.topology or ():
        argv += ["--topology", topology]
    for transport in args.transports if args.transports != ["auto"] else ():
        argv += ["--transport", transport]
    if args.dtype is not None:
        argv += ["--dtype", args.dtype]
    if args.no_reference:
        argv.append("--no-reference")
    if args.rounds is not None:
        argv += ["--rounds", str(args.rounds)]
    if args.json:
        argv.append("--json")
    proc = subprocess.Popen(isolated_argv(argv), start_new_session=True)

    def on_sigterm(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:  # interrupted: unshare --kill-child ends the whole session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def measure(args: argparse.Namespace) -> dict[str, object]:
    torch.set_num_threads(1)
    rate = link_bits_per_s(args.link)
    config = {"hosts": args.hosts, "receivers_per_host": args.receivers_per_host, "link": args.link,
              "link_bits_per_s": rate, "size_mb": args.size_mb, "dtype": args.dtype, "bucket_mb": args.bucket_mb,
              "pushes": args.pushes, "cpus": os.cpu_count(), "torch": torch.__version__}  # fmt: skip
    with SimHosts(args.hosts + 1) as hosts:
        for i in range(hosts.n):
            hosts.shape(i, args.link)
        assume_host(hosts.name(0))
        hosts.enter(0)  # this thread is the trainer on host 0; the store is hosted at its address
        if args.delta:
            result = _hostdelta.measure(args, hosts, placements(hosts, args.hosts, args.receivers_per_host))
            return {"config": {**config, "lr": args.lr, "delta_mode": args.delta_mode}, **result}
        if args.transports != ["auto"]:
            return _measure_transports(args, hosts, rate, config)
        return _measure_phases(args, hosts, rate, config)


def _measure_transports(
    args: argparse.Namespace, hosts: SimHosts, rate: float, config: dict[str, object]
) -> dict[str, object]:
    """Each ``--transport`` (gloo, NIXL) over each ``--topology`` (star: links or READs; chain: the relay's
    hops) in turn, ``--rounds`` times alternating so that load hits all alike, with the raw hop bounds."""
    if "nixl" in args.transports:
        os.environ["UCX_TLS"] = "tcp"  # UCX would take shared memory between simulated hosts of one machine
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL prints each agent's start on stdout (--json)
    spec = spec_for_size(args.size_mb)
    model = build_model(spec, seed=args.seed)
    topologies = args.topology or ["star"]
    rounds = args.rounds or (3 if len(args.transports) > 1 else 1)
    phases: dict[str, dict[str, object]] = {}
    measured: dict[str, list[dict[str, object]]] = {}
    for round_ in range(rounds):
        for topology in topologies:
            for transport in args.transports:
                name = transport if topology == "star" else f"{transport}/{topology}"
                if round_ == 0 and not args.no_reference and args.hosts > 1:
                    phases[f"one_host/{name}"] = _phase(model, spec, hosts, args, rate, n_hosts=1, topology=topology,
                                                        transport=transport)  # fmt: skip
                measured.setdefault(name, []).append(
                    _phase(model, spec, hosts, args, rate, n_hosts=args.hosts, topology=topology, transport=transport)
                )
    raws = {t: raw_hop(hosts, t, int(next(iter(measured.values()))[0]["pushed_bytes"]), reps=3,  # type: ignore[call-overload]
                       timeout_s=args.timeout_s) for t in args.transports}  # fmt: skip
    for name, runs in measured.items():
        phase = combine_rounds(runs)
        raw = raws[str(phase["transport"])]
        phase["raw_hop"] = raw
        phase["cpu_vs_raw"] = _ratio(phase["cpu_s_per_gb_per_hop"], raw["cpu_s_per_gb"])
        ones = phases.get(f"one_host/{name}")
        if ones is not None:
            phase["latency_vs_one_host"] = _ratio(phase["latency_s"], ones["latency_s"])
        phases[name] = phase
    return {"config": {**config, "transports": args.transports, "topologies": topologies, "rounds": rounds},
            "phases": phases, "ok": all(bool(p["ok"]) for p in phases.values())}  # fmt: skip


def combine_rounds(runs: list[dict[str, object]]) -> dict[str, object]:
    """One phase from its rounds: the median round's figures, with the median and the spread
    (each round's value) of the latency and of the CPU per GB per hop across all of them."""
    by_latency = sorted(runs, key=lambda p: float(p["latency_s"]))  # type: ignore[arg-type]
    phase = dict(by_latency[(len(runs) - 1) // 2])
    for key in ("latency_s", "cpu_s_per_gb_per_hop"):
        values = [float(p[key]) for p in runs]  # type: ignore[arg-type]
        phase[key] = statistics.median(values)
        phase[f"{key}_rounds"] = values
    phase["latency_vs_wire_bound"] = phase["latency_s"] / float(phase["wire_bound_s"])  # type: ignore[arg-type,operator]
    phase["ok"] = all(bool(p["ok"]) for p in runs)
    return phase


def _measure_phases(
    args: argparse.Namespace, hosts: SimHosts, rate: float, config: dict[str, object]
) -> dict[str, object]:
    """The topologies asked for (and the one-host reference) with a random model."""
    spec = spec_for_size(args.size_mb)
    model = build_model(spec, seed=args.seed)
    topologies = args.topology or list(_TOPOLOGIES)
    phases: dict[str, dict[str, object]] = {}
    if not args.no_reference and args.hosts > 1:
        reference = "chain" if topologies[0] == "tree" else topologies[0]  # one host: trees would only add a hop
        phases["one_host"] = _phase(model, spec, hosts, args, rate, n_hosts=1, topology=reference)
    for topology in topologies:
        phases[topology] = _phase(model, spec, hosts, args, rate, n_hosts=args.hosts, topology=topology)
    reference = phases.get("one_host")
    for name, phase in phases.items():
        if reference is not None and name != "one_host":
            phase["latency_vs_one_host"] = _ratio(phase["latency_s"], reference["latency_s"])
    return {
        "config": config,
        "phases": phases,
        "ok": all(bool(p["ok"]) for p in phases.values()),
    }


def _ratio(a: object, b: object) -> float | None:
    return a / b if isinstance(a, float) and isinstance(b, float) and b > 0 else None


def placements(hosts: SimHosts, n_hosts: int, per_host: int) -> list[Placement]:
    """``per_host`` receivers on each of rollout hosts 1..``n_hosts`` (host 0 is the trainer's)."""
    return [Placement(f"h{h}r{j}", hosts.netns_path(h), hosts.name(h))
            for h in range(1, n_hosts + 1) for j in range(per_host)]  # fmt: skip


def _phase(
    model: torch.nn.Module, spec: ModelSpec, hosts: SimHosts, args: argparse.Namespace, rate: float, *,
    n_hosts: int, topology: str, transport: str = "auto",
) -> dict[str, object]:  # fmt: skip
    placement = placements(hosts, n_hosts, args.receivers_per_host)
    # A chain over gloo is the relay's own hops, which the sender offers with transport='auto' (not 'gloo': links).
    sender_transport = "auto" if transport == "gloo" and topology != "star" else transport
    run = PushRun(model, spec, n_receivers=len(placement), transport=sender_transport, dtype=args.dtype,
                  bucket_mb=args.bucket_mb, timeout_s=args.timeout_s, store_host=hosts.address(0),
                  placement=placement, cross_host=topology, count_store=True)  # fmt: skip
    samples: list[dict[str, object]] = []
    with run:
        assert run.proxy is not None
        pushed = run.phase.pushed_bytes if run.phase is not None else 0
        for version in range(1, args.pushes + 2):
            tx0, _ = hosts.counters(0)
            asked0 = sum(run.proxy.snapshot().values())
            cpu0 = session_cpu_s()
            sample = run.push(version, warmup=version == 1, cpu=session_cpu_s)
            bench_cpu_s = session_cpu_s() - cpu0
            tx1, _ = hosts.counters(0)
            samples.append({"version": version, "warmup": version == 1, "latency_s": sample.latency_s,
                            "egress_bytes": tx1 - tx0, "egress_models": (tx1 - tx0) / pushed,
                            "store_requests": sum(run.proxy.snapshot().values()) - asked0,
                            "cpu_s": sample.cpu_s, "cpu_s_with_bench": bench_cpu_s,
                            "digest_ok": sample.digest_ok, "failed": sample.failed,
                            "delivered": sorted(sample.delivered), "applied": sample.applied})  # fmt: skip
        idle, idle_by_key = _idle_store_rate(run.proxy)
    timed = [s for s in samples if not s["warmup"]]
    wire_bound_s = pushed * 8 / rate
    tree = topology == "tree" or (topology == "relay" and prefer_tree(n_hosts))
    hops = tree_depth(n_hosts) if tree else n_hosts if topology in ("relay", "chain") else 1
    latency = statistics.median(float(s["latency_s"]) for s in timed)  # type: ignore[arg-type]
    egress = statistics.median(float(s["egress_models"]) for s in timed)  # type: ignore[arg-type]
    nic_s = egress * wire_bound_s
    # Copies that crossed a hop per push: one per receiver over links (the star), one per host through the relay.
    copies = len(placement) if topology == "star" else n_hosts
    cpu_s = statistics.median(float(s["cpu_s"]) for s in timed)  # type: ignore[arg-type]
    return {
        "transport": transport, "cpu_s_per_push": cpu_s, "cpu_s_per_gb_per_hop": cpu_s / (pushed * copies / 1e9),
        "topology": topology, "hosts": n_hosts, "receivers": len(placement), "pushed_bytes": pushed,
        "latency_s": latency, "wire_bound_s": wire_bound_s, "latency_vs_wire_bound": latency / wire_bound_s,
        "egress_models_per_push": egress, "hops": hops, "shape": "tree" if tree else topology,
        "per_hop_overhead_s": (latency - max(nic_s, wire_bound_s)) / hops,
        # The receivers' store requests (the sender's own are not counted): per push, from push()
        # until every receiver applied and hashed it; at idle, per second over _IDLE_S after the last.
        "store_requests_per_push": statistics.median(int(s["store_requests"]) for s in timed),  # type: ignore[call-overload]
        "store_idle_requests_per_s": idle, "store_idle_requests_per_s_per_host": idle / n_hosts,
        "store_idle_requests_by_key": idle_by_key,
        "samples": samples, "ok": all(bool(s["digest_ok"]) and not s["failed"] for s in samples),
    }  # fmt: skip


_IDLE_S = 3.0


def _idle_store_rate(proxy: CountingProxy) -> tuple[float, dict[str, int]]:
    """Requests per second the receivers send the store while nothing is pushed, and the
    window's requests by command and key pattern (``"compare_set /wsync/bench-#-*/news"``):
    3 s sees each periodic request of a host once or twice, so the count says which."""
    before, started = proxy.snapshot_keys(), time.monotonic()
    time.sleep(_IDLE_S)  # a measuring window, not synchronisation
    by_key = proxy.snapshot_keys() - before  # every request counted once, under its key
    return sum(by_key.values()) / (time.monotonic() - started), dict(sorted(by_key.items()))


def format_table(result: dict[str, object]) -> str:
    cfg = result["config"]
    assert isinstance(cfg, dict)
    title = (
        f"lightning-wsync bench across hosts: {cfg['hosts']} rollout hosts x {cfg['receivers_per_host']} receivers, "
        f"links {cfg['link']} (tc tbf), {cfg['size_mb']:g} MiB model, {cfg['pushes']} timed pushes (medians), "
        f"{cfg['cpus']} CPUs"
    )
    phases = result["phases"]
    assert isinstance(phases, dict)
    width = max([10, *(len(name) + 6 for name in phases)])
    header = (
        f"{'phase':<{width}} {'hosts':>5} {'recv':>5} {'latency s':>10} {'wire bound s':>13} {'x bound':>8} "
        f"{'x 1 host':>9} {'egress models':>14} {'hop overhead s':>15} {'store req/push':>15} "
        f"{'idle req/s/host':>16} {'bit-exact':>10} {'CPU s/GB/hop':>13} {'x raw':>6}"
    )
    lines = [title, header]
    for name, p in phases.items():
        vs_one = p.get("latency_vs_one_host")
        lines.append(
            f"{name:<{width}} {p['hosts']:>5} {p['receivers']:>5} {p['latency_s']:>10.2f} {p['wire_bound_s']:>13.2f} "
            f"{p['latency_vs_wire_bound']:>8.2f} {'-' if vs_one is None else f'{vs_one:.2f}':>9} "
            f"{p['egress_models_per_push']:>14.2f} {p['per_hop_overhead_s']:>15.2f} "
            f"{p.get('store_requests_per_push', 0):>15.0f} {p.get('store_idle_requests_per_s_per_host', 0):>16.1f} "
            f"{'yes' if p['ok'] else 'NO':>10} {p.get('cpu_s_per_gb_per_hop', 0):>13.2f} "
            f"{'-' if p.get('cpu_vs_raw') is None else format(p['cpu_vs_raw'], '.2f'):>6}"
        )
        rounds = p.get("latency_s_rounds")
        if isinstance(rounds, list) and len(rounds) > 1:  # the spread: each round's figure, in the order measured
            cpu = p["cpu_s_per_gb_per_hop_rounds"]
            lines.append(f"{'':<{width}} {len(rounds)} rounds: latency s {' '.join(f'{x:.2f}' for x in rounds)}; "
                         f"CPU s/GB/hop {' '.join(f'{x:.2f}' for x in cpu)}")  # fmt: skip
        raw = p.get("raw_hop")
        if isinstance(raw, dict):
            blank = " " * (13 + 8 + 9 + 14 + 15 + 15 + 16 + 10 + 7)  # the columns the raw hop has no figure for
            lines.append(f"{'  raw ' + name:<{width}} {'':>5} {1:>5} {raw['latency_s']:>10.2f} {blank} "
                         f"{raw['cpu_s_per_gb']:>13.2f}")  # fmt: skip
    return "\n".join(lines)
