"""``lightning-wsync bench --trainer-ranks W --strategy ddp|fsdp``: a Lightning trainer of W
ranks on CPU (gloo) pushing the benchmark model every step, with ``sharded=False`` (rank 0
sends everything, after a gather under FSDP2) and with the callback's default (``"auto"``:
every rank writes its share), against one rank pushing the same model, in the same run; by
default under DDP, then FSDP2 (``--strategy both``).

::

    lightning-wsync bench --trainer-ranks 2 --size-mb 128

Each configuration is its own trainer (:mod:`~lightning_wsync.bench._ranks_trainer`, one
torch thread per rank) with ``--receivers`` receiver processes on this host following
the job. Reported per configuration: each rank's median stall per push (time in the push
hook), a push's stall (the slowest rank's: the others wait for it at the next
collective), the CPU time of each rank's training thread in the hook (the push's own work,
which other processes' load does not inflate; per push the largest over the ranks), each
rank's memory per push (the peak resident memory during the push hook above what the rank
held just before it: FSDP2's gathered copy without sharding; median
and largest of the pushes after the first few), each rank's peak resident memory over the
run above what it held before the callback started (snapshot rings, FSDP2's CPU mirror,
but also the training's own gradients), and the median delivery latency (push to the last
receiver's acknowledgement, from the push reports). With ``--profile-threads``, also which
threads of the bench's processes ran while each rank was in its hook, and where the other ranks
were meanwhile (:mod:`~lightning_wsync.bench._threads`).

Longer than 60 lines: `_one` is one run in order (receivers, the trainer, their outputs, the row).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from lightning_wsync import WeightReceiver, WeightSyncClosedError
from lightning_wsync.bench._threads import profile, python_names
from lightning_wsync.testing.models import ModelSpec, build_model, spec_for_size
from lightning_wsync.testing.procs import BenchError, Children, init_child, receive, report_failure
from lightning_wsync.testing.stores import host_store

_WARMUP = 2  # pushes left out of the medians: first touches of buffers and pages


def run_ranks(args: argparse.Namespace) -> int:
    """Run every configuration; print the table (or JSON); return the exit status."""
    spec = spec_for_size(args.size_mb)
    strategies = ["ddp", "fsdp"] if args.strategy == "both" else [args.strategy]
    rows: list[dict[str, Any]] = []
    try:
        for strategy in strategies:
            group = [_one(args, spec, strategy, ranks, sharded)
                     for ranks, sharded in [(1, "auto"), (args.trainer_ranks, "false"), (args.trainer_ranks, "auto")]]
            base, cpu_base = group[0]["stall_s"], group[0]["cpu_s"]
            for row in group:
                row["vs_one_rank"] = row["stall_s"] / base if base else None
                row["cpu_vs_one_rank"] = row["cpu_s"] / cpu_base if cpu_base else None
            rows += group
    except BenchError as exc:
        print(f"lightning-wsync bench: {exc}", file=sys.stderr)
        return 1
    result = {"size_mb": args.size_mb, "strategy": args.strategy, "trainer_ranks": args.trainer_ranks,
              "receivers": args.receivers, "pushes": args.pushes, "rows": rows}  # fmt: skip
    print(json.dumps(result, indent=2) if args.json else _table(args, rows))
    return 0


def _one(args: argparse.Namespace, spec: ModelSpec, strategy: str, ranks: int, sharded: str) -> dict[str, Any]:
    """One trainer run and its receivers; the medians of what its ranks measured."""
    port = _free_port()
    store = host_store("127.0.0.1", port, timeout_s=args.timeout_s)
    job = f"ranks{ranks}{strategy}{sharded}"
    steps = args.pushes + _WARMUP
    with tempfile.TemporaryDirectory(prefix="wsync-bench-ranks-") as out, Children() as children:
        conns = [children.start(_receiver, (f"127.0.0.1:{port}", job, spec, args.timeout_s), name=f"receiver-{i}")
                 for i in range(args.receivers)]  # fmt: skip
        roles = {"bench": os.getpid(), **{f"receiver-{i}": pid for i, pid in enumerate(children.pids)}}
        for conn in conns:
            receive(conn, args.timeout_s, "a receiver's start")
        cmd = [sys.executable, "-m", "lightning_wsync.bench._ranks_trainer", "--d-model", str(spec.d_model),
               "--vocab", str(spec.vocab), "--ranks", str(ranks), "--strategy", strategy, "--steps", str(steps),
               "--store", f"127.0.0.1:{port}", "--job", job, "--out", out, "--timeout-s", str(args.timeout_s),
               "--sharded", sharded]  # fmt: skip
        if args.profile_threads:
            cmd += ["--profile-pids", ",".join(f"{role}={pid}" for role, pid in roles.items())]
        # A fixed mmap threshold: blocks of 1 MiB and more go back to the system when freed, so a
        # push's peak resident rise is what it allocates, not hidden by pages glibc kept from the last.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(2**20)}
        trainer = subprocess.Popen(cmd, env=env, cwd=out, start_new_session=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            output, _ = trainer.communicate(timeout=args.timeout_s * 4)
        except subprocess.TimeoutExpired:
            output = ""
        finally:
            if trainer.poll() is None:
                os.killpg(trainer.pid, signal.SIGKILL)
                trainer.wait()
        if trainer.returncode != 0:
            raise BenchError(f"the {ranks}-rank trainer failed (exit {trainer.returncode}):\n{output[-3000:]}")
        names = {f"bench/{tid}": name for tid, name in python_names().items()}
        for i, conn in enumerate(conns):
            _, _, theirs = receive(conn, args.timeout_s, "a receiver's end")
            assert isinstance(theirs, dict)
            names.update({f"receiver-{i}/{tid}": name for tid, name in theirs.items()})
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(ranks)]
    del store
    stalls = [_median(r["stall_s"]) for r in per_rank]
    slowest = [max(s) for s in zip(*(r["stall_s"][_WARMUP:] for r in per_rank))]
    pushed_sharded = bool(per_rank[0].get("sharded_push"))
    profiled = {}
    if args.profile_threads:
        for r, rec in enumerate(per_rank):
            names.update({key: name for key, name in rec["profile"]["comms"].items() if key not in names})
            names.update({f"rank{r}/{tid}": name for tid, name in rec["profile"]["py_names"].items()})
        profiled = {"threads": profile([rec["profile"] for rec in per_rank], names, _WARMUP)}
    return {
        "config": f"{ranks} rank{'s' if ranks > 1 else ''}" + (f", {strategy}" if ranks > 1 else "")
        + ("" if ranks == 1 else ", sharded=False" if sharded == "false" else ", default"),
        "strategy": strategy,
        "sharded_push": pushed_sharded,
        "unsharded_reason": per_rank[0].get("unsharded_reason"),
        "stall_s": statistics.median(slowest),
        "rank_stall_s": stalls,
        # CPU time of each rank's training thread in the hook (the push's own work; waiting and being
        # preempted by other processes do not count), and per push the largest over the ranks.
        "cpu_s": statistics.median(max(c) for c in zip(*(r["cpu_s"][_WARMUP:] for r in per_rank))),
        "rank_cpu_s": [_median(r["cpu_s"]) for r in per_rank],
        "rank_push_rise_mib": [_median(r["push_rise_mib"]) for r in per_rank],
        "rank_push_rise_max_mib": [max(r["push_rise_mib"][_WARMUP:] or r["push_rise_mib"]) for r in per_rank],
        "rank_peak_rise_mib": [r["peak_rise_mib"] for r in per_rank],
        "delivery_s": _median(per_rank[0]["delivery_s"], warmup=0) if per_rank[0]["delivery_s"] else None,
        **profiled,
    }


def _median(values: list[float], warmup: int = _WARMUP) -> float:
    return statistics.median(values[warmup:] or values)


def _receiver(conn: Connection, store: str, job: str, spec: ModelSpec, timeout_s: float) -> None:
    """Follow the job until its sender closes; say when ready and when done."""
    init_child()
    try:
        model = build_model(spec, seed=None)
        with WeightReceiver(model, store=store, job=job, timeout_s=timeout_s) as receiver:
            conn.send(("ready",))
            want = 0
            names = python_names()
            while True:
                try:
                    want = receiver.wait_for_version(want, timeout_s=timeout_s * 4) + 1
                except WeightSyncClosedError:
                    break
                names.update(python_names())  # for --profile-threads: its threads by name
        conn.send(("done", want - 1, names))
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the run
        report_failure(conn, "receiver")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"trainer ranks {args.trainer_ranks}, {args.strategy}, {args.size_mb:g} MiB float32 policy, a push every "
        f"step, {args.receivers} receiver(s) on this host; medians of {args.pushes} pushes after {_WARMUP}",
        "| trainer | stall per push (slowest rank) | / one rank | stall by rank | CPU per push (largest rank) "
        "| / one rank | memory per push, by rank (MiB) | run's memory rise (MiB) | delivery |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ranks = ", ".join(f"{s * 1e3:.1f} ms" for s in row["rank_stall_s"])
        pushes = ", ".join(f"{m:.1f} (max {x:.1f})" for m, x in zip(row["rank_push_rise_mib"],
                                                                   row["rank_push_rise_max_mib"]))  # fmt: skip
        rises = ", ".join(f"{m:.0f}" for m in row["rank_peak_rise_mib"])
        delivery = "—" if row["delivery_s"] is None else f"{row['delivery_s'] * 1e3:.0f} ms"
        lines.append(f"| {row['config']} | {row['stall_s'] * 1e3:.1f} ms | {row['vs_one_rank']:.2f} | {ranks} | "
                     f"{row['cpu_s'] * 1e3:.1f} ms | {row['cpu_vs_one_rank']:.2f} | "
                     f"{pushes} | {rises} | {delivery} |")  # fmt: skip
    for row in rows:
        for rank in row.get("threads", []):
            busiest = ", ".join(f"{name} {ms:.1f}" for name, ms in rank["threads_ms"].items())
            lines.append(f"{row['config']}, rank {rank['rank']}: hook {rank['window_ms']:.1f} ms, its thread's CPU "
                         f"{rank['own_cpu_ms']:.1f} ms, waiting for a CPU {rank['own_wait_ms']:.1f} ms; the bench's "
                         f"threads {rank['bench_cpu_ms']:.1f} ms, the machine {rank['machine_cpu_ms']:.1f} ms "
                         f"of CPU per push; busiest (ms): {busiest}; other ranks: {rank['other_ranks']}")  # fmt: skip
    return "\n".join(lines)
