"""The push phase: a real WeightSender here, real WeightReceivers in spawned processes.

Each receiver (``_receivers``) reports the moment it *applied* a version and, once all
have applied, a hash of its module for the bit-exactness check. A push's latency runs
from the call to ``push()`` until the last receiver applied it; pushes are sequential,
so every receiver is idle when the next one starts.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

import torch
from torch import nn

from lightning_wsync import WeightSender
from lightning_wsync.bench._memory import MemGrowth, growth, reset_peak
from lightning_wsync.bench._receivers import Placement, ReceiverArgs, receiver_main, receiver_on_host
from lightning_wsync.config import SenderConfig
from lightning_wsync.testing.models import ModelSpec, digest, mutate
from lightning_wsync.testing.procs import BenchError, Children, receive
from lightning_wsync.testing.storeproxy import CountingProxy

log = logging.getLogger(__name__)

# Pushes alternate between the sender's two snapshot slots: one warm-up push per slot, so
# the first use of each (pages first touched by the copies) stays out of the timed ones.
WARMUP_PUSHES = 2


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
    delta_receivers: tuple[str, ...] = ()  # the report's delta figures (network path)
    delta_bytes: int | None = None
    delta_changed_share: float | None = None
    delta_encode_s: float | None = None
    delta_decode_s: float | None = None
    cpu_s: float | None = None  # push(cpu=...): CPU from push() until every receiver applied it

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
            "delta_receivers": sorted(self.delta_receivers),
            "delta_bytes": self.delta_bytes,
            "delta_changed_share": self.delta_changed_share,
            "delta_encode_s": self.delta_encode_s,
            "delta_decode_s": self.delta_decode_s,
            "cpu_s": self.cpu_s,
        }


@dataclass
class PushPhase:
    """Everything the push phase measured."""

    pushed_bytes: int
    n_tensors: int
    samples: list[PushSample] = field(default_factory=list)
    sender_memory: MemGrowth | None = None
    receiver_memory: dict[str, MemGrowth] = field(default_factory=dict)


class PushRun:
    """A real sender here and its receivers in spawned processes; pushes one version at a time.

    ::

        with PushRun(model, spec, n_receivers=4, ...) as run:
            for version in range(1, 7):
                run.push(version)
        phase = run.phase  # samples, memory
    """

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        *,
        n_receivers: int,
        transport: str,
        dtype: str | None,
        bucket_mb: float = SenderConfig.bucket_mb,
        apply: str = "copy",
        timeout_s: float,
        store_host: str = "127.0.0.1",
        placement: Sequence[Placement] | None = None,
        cross_host: str = SenderConfig.cross_host,
        change: Callable[[nn.Module, int], None] = mutate,
        sender_options: dict[str, Any] | None = None,
        count_store: bool = False,
    ) -> None:
        """``change(model, version)`` makes each version's weights before its push;
        ``sender_options``: further WeightSender keyword arguments (e.g. ``delta``);
        ``count_store``: receivers reach the store through a counting proxy (:attr:`proxy`)."""
        self._model = model
        self._change = change
        self._sender_options = dict(sender_options or {})
        self._spec = spec
        self._placement = {p.name: p for p in placement or ()}
        self._names = list(self._placement) if placement else [f"r{i}" for i in range(n_receivers)]
        self._store_host = store_host
        self._cross_host = cross_host
        self._transport = transport
        self._dtype = dtype
        self._wire_dtype = None if dtype is None else getattr(torch, dtype)
        self._bucket_mb = bucket_mb
        self._apply = apply
        self._timeout_s = timeout_s
        self._sender: WeightSender | None = None
        self._children: Children | None = None
        self._conns: dict[str, Connection] = {}
        self._last_mem: dict[str, dict[str, int]] = {}
        self._base = reset_peak()
        self._sender_memory: MemGrowth | None = None
        self.phase: PushPhase | None = None
        self._count_store = count_store
        self.proxy: CountingProxy | None = None  # every receiver's store requests, when counted

    def __enter__(self) -> PushRun:
        job = f"bench-{os.getpid()}-{time.monotonic_ns()}"
        gc.collect()  # memory freed now, not during the run, where it would offset the growth measured
        self._base = reset_peak()
        self._sender = WeightSender(self._model, store=f"{self._store_host}:0", job=job, transport=self._transport,
                                    dtype=self._dtype, bucket_mb=self._bucket_mb, timeout_s=self._timeout_s,
                                    cross_host=self._cross_host, **self._sender_options)  # fmt: skip
        self.phase = PushPhase(pushed_bytes=self._sender.layout.total_bytes, n_tensors=len(self._sender.layout.entries))
        try:
            self._children = Children().__enter__()
            address = self._sender.store_address
            assert address is not None
            if self._count_store:
                host, port = address.rsplit(":", 1)
                self.proxy = CountingProxy(host, int(port), host=host)
                address = self.proxy.address
            for n in self._names:
                args = ReceiverArgs(address, job, n, self._spec, self._dtype, self._apply, self._timeout_s)
                where = self._placement.get(n)
                if where is not None:
                    self._conns[n] = self._children.start(
                        receiver_on_host, (where.netns, where.host_id, args), name=f"wsync-bench-{n}"
                    )
                else:
                    self._conns[n] = self._children.start(receiver_main, (args,), name=f"wsync-bench-{n}")
            # Many receivers importing torch at once on a few cores start slowly: bound the
            # start-up by the receiver count, not by timeout_s alone.
            startup_s = self._timeout_s * max(1.0, len(self._names) / 4)
            for n, conn in self._conns.items():
                receive(conn, startup_s, f"receiver {n} to start")
            wait_registered(self._sender, self._names, startup_s)
        except BaseException as exc:
            self.__exit__(type(exc), exc, None)
            raise
        return self

    def push(self, version: int, *, warmup: bool = False, cpu: Callable[[], float] | None = None) -> PushSample:
        """Change the model, push ``version``, wait until every receiver applied and hashed it.

        ``cpu``: a CPU clock (seconds) read just before ``push()`` and again once every
        receiver said it applied the version, before the bench's own hashing (the model's
        change and the digests are the bench's work, not the plane's).
        """
        sender, phase, timeout_s = self._sender, self.phase, self._timeout_s
        assert sender is not None and phase is not None, "use PushRun as a context manager"
        self._change(self._model, version)
        expected = digest(self._model, self._wire_dtype)
        cpu0 = None if cpu is None else cpu()
        started = time.monotonic()
        handle = sender.push(version)
        stall = time.monotonic() - started
        report = handle.wait(timeout_s)
        applied_at: dict[str, float] = {}
        applied: dict[str, int] = {}
        digest_ok = True
        for n, conn in self._conns.items():
            _, got, at, mem = receive(conn, timeout_s, f"receiver {n} to apply version {version}")
            assert isinstance(got, int) and isinstance(at, float) and isinstance(mem, dict)
            applied[n], applied_at[n], self._last_mem[n] = got, at, mem
            digest_ok = digest_ok and got == version
        cpu_s = None if cpu is None or cpu0 is None else cpu() - cpu0
        for conn in self._conns.values():
            conn.send(("digest",))
        for n, conn in self._conns.items():
            got_digest = receive(conn, timeout_s, f"receiver {n} to hash version {version}")[2]
            digest_ok = digest_ok and got_digest == expected
        sample = PushSample(
            version=version, warmup=warmup, stall_s=stall, core_stall_s=handle.stall_s,
            latency_s=max(applied_at.values()) - started, report_latency_s=report.latency_s,
            delivered=report.delivered, failed=dict(report.failed), applied=applied, digest_ok=digest_ok,
            delta_receivers=report.delta_receivers, delta_bytes=report.delta_bytes,
            delta_changed_share=report.delta_changed_share, delta_encode_s=report.delta_encode_s,
            delta_decode_s=report.delta_decode_s, cpu_s=cpu_s,
        )  # fmt: skip
        phase.samples.append(sample)
        log.debug("push %d: %s", version, sample)
        return sample

    def freeze_sender_memory(self) -> None:
        """Take the sender's memory figure now (before another sender in this process starts)."""
        self._sender_memory = growth(self._base)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        sender, children, phase = self._sender, self._children, self.phase
        try:
            if exc_type is None and sender is not None and phase is not None:
                phase.sender_memory = self._sender_memory or growth(self._base)
                phase.receiver_memory = {
                    n: MemGrowth(peak_rss=m["peak_rss_bytes"], anon=m["anon_bytes"], shmem=m["shmem_bytes"])
                    for n, m in self._last_mem.items()
                }
                sender.close(flush_timeout_s=0)
                for n, conn in self._conns.items():
                    receive(conn, self._timeout_s, f"receiver {n} to see the sender close")
        finally:
            try:
                if children is not None:
                    children.__exit__(exc_type, exc, tb)
            finally:
                if sender is not None:
                    sender.close(flush_timeout_s=0)
                if self.proxy is not None:
                    self.proxy.close()


def run_push_phase(
    model: nn.Module,
    spec: ModelSpec,
    *,
    pushes: int,
    between: Callable[[], None] | None = None,
    **options: Any,
) -> PushPhase:
    """``WARMUP_PUSHES`` warm-up pushes and ``pushes`` timed ones to ``n_receivers`` receiver processes.

    ``between`` runs after each timed push, once every receiver has applied it;
    ``options`` are :class:`PushRun`'s.
    """
    run = PushRun(model, spec, **options)
    with run:
        for version in range(1, pushes + WARMUP_PUSHES + 1):
            run.push(version, warmup=version <= WARMUP_PUSHES)
            if between is not None and version > WARMUP_PUSHES:
                between()
    assert run.phase is not None
    return run.phase


def wait_registered(sender: WeightSender, names: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not set(names) <= set(sender.receivers()):
        if time.monotonic() > deadline:
            raise BenchError(
                f"bench: receivers {sorted(set(names) - set(sender.receivers()))} did not register with the "
                f"sender within {timeout_s:.0f} s (raise --timeout-s)"
            )
        time.sleep(0.01)
