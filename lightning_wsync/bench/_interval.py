"""``bench --interval-ms``: pushes at a fixed pace, receivers following as fast as they can.

The other phases push one version at a time and wait for it everywhere; this one is
the regime of a small policy pushed every step: the sender pushes every ``interval_ms``
for ``duration_s`` whether or not receivers kept up, and each receiver applies the
newest version as soon as it can (``wait_for_version(held + 1)`` in a loop). Reported
per receiver: the fraction of published versions it applied, and the age of the
version it held (time since that version was pushed), sampled every millisecond over
the run; for the sender: pushes, dropped pushes and superseded sends. The run ends
with one more push, waited for everywhere and checked bit-exact.
"""

from __future__ import annotations

import os
import statistics
import time
from multiprocessing.connection import Connection

import torch

from lightning_wsync import WeightSender, WeightSyncClosedError, WeightSyncTimeoutError
from lightning_wsync.bench._push import wait_registered
from lightning_wsync.bench._receivers import ReceiverArgs, receiver_child
from lightning_wsync.testing.models import ModelSpec, build_model, digest, mutate
from lightning_wsync.testing.procs import BenchError, Children, receive

_SAMPLE_S = 0.001


def _follower_main(conn: Connection, args: ReceiverArgs) -> None:
    with receiver_child(conn, args) as child:
        applied: list[tuple[float, int]] = []
        want = 0
        while not conn.poll():
            try:
                version = child.receiver.wait_for_version(want, timeout_s=0.2)
            except WeightSyncTimeoutError:
                continue
            except WeightSyncClosedError:
                break
            applied.append((time.monotonic(), version))
            want = version + 1
        final = conn.recv()[1]
        child.receiver.wait_for_version(final, timeout_s=args.timeout_s)
        conn.send(("done", applied, child.receiver.version, digest(child.model, child.wire_dtype)))


def run_interval_phase(
    spec: ModelSpec, *, n_receivers: int, transport: str, dtype: str | None, bucket_mb: float, apply: str,
    interval_ms: float, duration_s: float, timeout_s: float, seed: int,
) -> dict[str, object]:  # fmt: skip
    """Push every ``interval_ms`` for ``duration_s``; the per-receiver figures above, JSON-able."""
    model = build_model(spec, seed=seed)
    wire_dtype = None if dtype is None else getattr(torch, dtype)
    job = f"bench-interval-{os.getpid()}-{time.monotonic_ns()}"
    names = [f"r{i}" for i in range(n_receivers)]
    pushed_at: dict[int, float] = {}
    with WeightSender(model, store="127.0.0.1:0", job=job, transport=transport, dtype=dtype,
                      bucket_mb=bucket_mb, timeout_s=timeout_s) as sender, Children() as children:  # fmt: skip
        address = sender.store_address
        assert address is not None
        conns = {n: children.start(_follower_main, (ReceiverArgs(address, job, n, spec, dtype, apply, timeout_s),),
                                   name=f"wsync-bench-{n}") for n in names}  # fmt: skip
        for n, conn in conns.items():
            receive(conn, timeout_s, f"receiver {n} to start")
        wait_registered(sender, names, timeout_s)
        pushed_at[0] = time.monotonic()
        sender.push(0, wait_for_slot_s=timeout_s).wait(timeout_s)
        started = time.monotonic()
        stalls = _paced_pushes(sender, model, pushed_at, started, interval_ms=interval_ms, duration_s=duration_s)
        version = len(stalls)
        ended = time.monotonic()
        final = version + 1
        mutate(model, final)
        expected = digest(model, wire_dtype)
        pushed_at[final] = time.monotonic()
        sender.push(final, wait_for_slot_s=timeout_s)
        for conn in conns.values():
            conn.send(("final", final))
        outcomes = {
            n: receive(conn, timeout_s, f"receiver {n} to apply the final version") for n, conn in conns.items()
        }
        dropped, superseded = sender.dropped_pushes, sender.superseded_sends
    published = [v for v in pushed_at if 1 <= v <= version]
    receivers = {n: _receiver_figures(outcome, pushed_at, len(published), version, (started, ended), (final, expected))
                 for n, outcome in outcomes.items()}  # fmt: skip
    ok = all(r["bit_exact"] for r in receivers.values())
    if not ok:
        raise BenchError(f"bench: a receiver did not end bit-exact at version {final}: {receivers}")
    return {
        "interval_ms": interval_ms,
        "duration_s": ended - started,
        "pushes": version,
        "published": len(published),
        "dropped": dropped,
        "superseded_sends": superseded,
        "stall_median_s": statistics.median(stalls) if stalls else None,
        "receivers": receivers,
        "ok": ok,
    }


def _paced_pushes(
    sender: WeightSender, model: torch.nn.Module, pushed_at: dict[int, float], started: float, *,
    interval_ms: float, duration_s: float,
) -> list[float]:
    """Versions 1, 2, ... every ``interval_ms`` from ``started`` for ``duration_s``; each push's stall.

    ``pushed_at`` gets the push time of every version published (not dropped).
    """
    stalls: list[float] = []
    version = 0
    while (now := time.monotonic()) < started + duration_s:
        version += 1
        mutate(model, version)
        handle = sender.push(version)
        stalls.append(handle.stall_s)
        if not handle.dropped:
            pushed_at[version] = now
        next_tick = started + version * interval_ms / 1000
        time.sleep(max(0.0, next_tick - time.monotonic()))  # pacing the pushes, not synchronisation
    return stalls


def _receiver_figures(
    outcome: tuple[object, ...], pushed_at: dict[int, float], n_published: int, last: int,
    window: tuple[float, float], final: tuple[int, str],
) -> dict[str, object]:
    """One receiver's share of the versions ``1..last`` applied, the age of what it held, bit-exactness."""
    _, applied, held, got = outcome
    assert isinstance(applied, list)
    in_run = [(t, v) for t, v in applied if 1 <= v <= last]
    ages = _ages(applied, pushed_at, *window)
    return {
        "applied": len(in_run),
        "applied_fraction": len(in_run) / max(1, n_published),
        "age_median_s": statistics.median(ages) if ages else None,
        "age_p95_s": _p95(ages),
        "bit_exact": (held, got) == final,
    }


def _ages(applied: list[tuple[float, int]], pushed_at: dict[int, float], start: float, end: float) -> list[float]:
    """Age of the held version at every millisecond in [start, end)."""
    ages: list[float] = []
    held: int | None = None
    i = 0
    t = start
    while t < end:
        while i < len(applied) and applied[i][0] <= t:
            held = applied[i][1]
            i += 1
        if held is not None and held in pushed_at:
            ages.append(t - pushed_at[held])
        t += _SAMPLE_S
    return ages


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def format_interval(result: dict[str, object]) -> str:
    """The interval run as a small table."""
    lines = [
        f"pushes every {result['interval_ms']} ms for {result['duration_s']:.1f} s: {result['pushes']} pushes, "
        f"{result['dropped']} dropped (every slot being read), {result['superseded_sends']} sends superseded; "
        f"median stall {_ms(result['stall_median_s'])}",
        f"{'receiver':<10} {'applied':>8} {'fraction':>9} {'age median':>11} {'age p95':>9}  bit-exact",
    ]
    receivers = result["receivers"]
    assert isinstance(receivers, dict)
    for n, r in receivers.items():
        lines.append(f"{n:<10} {r['applied']:>8} {r['applied_fraction']:>9.2f} {_ms(r['age_median_s']):>11} "
                     f"{_ms(r['age_p95_s']):>9}  {r['bit_exact']}")  # fmt: skip
    return "\n".join(lines)


def _ms(value: object) -> str:
    return "-" if not isinstance(value, float) else f"{value * 1000:.1f} ms"
