"""The push phase: a real WeightSender here, real WeightReceivers in spawned processes.

Each receiver loops on ``wait_for_version`` and, once a version is *applied* to its
module, reports the moment (``time.monotonic()``, one clock for the host) and its
memory growth through a pipe; once all have applied, each hashes its module for the
bit-exactness check. A push's latency runs from the call to ``push()`` until the last
receiver applied it; pushes are sequential, so every receiver is idle when the next
one starts.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch
from torch import nn

from lightning_wsync import WeightReceiver, WeightSender, WeightSyncClosedError
from lightning_wsync.bench._memory import MemGrowth, growth, reset_peak
from lightning_wsync.bench._model import ModelSpec, build_model, digest, mutate
from lightning_wsync.config import SenderConfig
from lightning_wsync.bench._procs import BenchError, Children, init_child, receive, report_failure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushSample:
    """One push as the benchmark saw it."""

    version: int
    warmup: bool
    stall_s: float  # push() wall time on the caller
    core_stall_s: float  # PushHandle.stall_s: the snapshot alone
    latency_s: float  # push() start -> last receiver applied it
    report_latency_s: float | None  # PushReport.latency_s: the core's own (acknowledgement) view
    delivered: tuple[str, ...]
    failed: dict[str, str]
    applied: dict[str, int]  # receiver -> version it applied in answer to this push
    digest_ok: bool

    def to_json(self) -> dict[str, object]:
        return {
            "version": self.version,
            "warmup": self.warmup,
            "stall_s": self.stall_s,
            "core_stall_s": self.core_stall_s,
            "latency_s": self.latency_s,
            "report_latency_s": self.report_latency_s,
            "delivered": sorted(self.delivered),
            "failed": dict(self.failed),
            "applied": dict(self.applied),
            "digest_ok": self.digest_ok,
        }


@dataclass
class PushPhase:
    """Everything the push phase measured."""

    pushed_bytes: int
    n_tensors: int
    samples: list[PushSample] = field(default_factory=list)
    sender_memory: MemGrowth | None = None
    receiver_memory: dict[str, MemGrowth] = field(default_factory=dict)


def _receiver_main(
    conn: Connection, store: str, job: str, name: str, spec: ModelSpec, wire: str | None, apply: str,
    timeout_s: float,
) -> None:
    init_child()
    try:
        model = build_model(spec, seed=None)
        wire_dtype = None if wire is None else getattr(torch, wire)
        if wire_dtype is not None:
            model = model.to(wire_dtype)  # rollout modules in the wire dtype, as bf16 inference engines hold them
        base = reset_peak()
        with WeightReceiver(model, store=store, job=job, name=name, timeout_s=timeout_s, apply=apply) as receiver:
            conn.send(("ready", os.getpid()))
            want = 0
            while True:
                try:
                    version = receiver.wait_for_version(want, timeout_s=timeout_s)
                except WeightSyncClosedError:
                    break
                applied_at = time.monotonic()
                conn.send(("applied", version, applied_at, growth(base).to_json()))
                # Hash only once every receiver has applied: hashing now would steal CPU from
                # receivers still copying and inflate the latency being measured.
                if not conn.poll(timeout_s) or conn.recv() != ("digest",):
                    raise BenchError(f"bench: receiver {name} got no digest request for version {version}")
                conn.send(("digest", version, digest(model, wire_dtype)))
                want = version + 1
        conn.send(("closed",))
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        report_failure(conn, f"receiver {name}")


def run_push_phase(
    model: nn.Module,
    spec: ModelSpec,
    *,
    n_receivers: int,
    pushes: int,
    transport: str,
    dtype: str | None,
    bucket_mb: float = SenderConfig.bucket_mb,
    apply: str = "copy",
    timeout_s: float,
    between: Callable[[], None] | None = None,
) -> PushPhase:
    """One warm-up push and ``pushes`` timed ones to ``n_receivers`` receiver processes.

    ``between`` runs after each timed push, once every receiver has applied it.
    """
    wire_dtype = None if dtype is None else getattr(torch, dtype)
    names = [f"r{i}" for i in range(n_receivers)]
    job = f"bench-{os.getpid()}-{time.monotonic_ns()}"
    base = reset_peak()
    sender = WeightSender(model, store="127.0.0.1:0", job=job, transport=transport, dtype=dtype,
                          bucket_mb=bucket_mb, timeout_s=timeout_s)
    phase = PushPhase(pushed_bytes=sender.layout.total_bytes, n_tensors=len(sender.layout.entries))
    try:
        with Children() as children:
            address = sender.store_address
            assert address is not None
            conns = {
                n: children.start(_receiver_main, (address, job, n, spec, dtype, apply, timeout_s), name=f"wsync-bench-{n}")
                for n in names
            }
            for n, conn in conns.items():
                receive(conn, timeout_s, f"receiver {n} to start")
            _wait_registered(sender, names, timeout_s)
            last_mem: dict[str, dict[str, int]] = {}
            for version in range(1, pushes + 2):
                mutate(model, version)
                expected = digest(model, wire_dtype)
                started = time.monotonic()
                handle = sender.push(version)
                stall = time.monotonic() - started
                report = handle.wait(timeout_s)
                applied_at: dict[str, float] = {}
                applied: dict[str, int] = {}
                digest_ok = True
                for n, conn in conns.items():
                    _, got, at, mem = receive(conn, timeout_s, f"receiver {n} to apply version {version}")
                    assert isinstance(got, int) and isinstance(at, float) and isinstance(mem, dict)
                    applied[n], applied_at[n], last_mem[n] = got, at, mem
                    digest_ok = digest_ok and got == version
                for conn in conns.values():
                    conn.send(("digest",))
                for n, conn in conns.items():
                    got_digest = receive(conn, timeout_s, f"receiver {n} to hash version {version}")[2]
                    digest_ok = digest_ok and got_digest == expected
                phase.samples.append(
                    PushSample(
                        version=version,
                        warmup=version == 1,
                        stall_s=stall,
                        core_stall_s=handle.stall_s,
                        latency_s=max(applied_at.values()) - started,
                        report_latency_s=report.latency_s,
                        delivered=report.delivered,
                        failed=dict(report.failed),
                        applied=applied,
                        digest_ok=digest_ok,
                    )
                )
                log.debug("push %d: %s", version, phase.samples[-1])
                if between is not None and version > 1:
                    between()
            phase.sender_memory = growth(base)
            phase.receiver_memory = {
                n: MemGrowth(peak_rss=m["peak_rss_bytes"], anon=m["anon_bytes"], shmem=m["shmem_bytes"])
                for n, m in last_mem.items()
            }
            sender.close(flush_timeout_s=0)
            for n, conn in conns.items():
                receive(conn, timeout_s, f"receiver {n} to see the sender close")
    finally:
        sender.close(flush_timeout_s=0)
    return phase


def _wait_registered(sender: WeightSender, names: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not set(names) <= set(sender.receivers()):
        if time.monotonic() > deadline:
            raise BenchError(
                f"bench: receivers {sorted(set(names) - set(sender.receivers()))} did not register with the "
                f"sender within {timeout_s:.0f} s (raise --timeout-s)"
            )
        time.sleep(0.01)
