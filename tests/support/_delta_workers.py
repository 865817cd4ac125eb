"""Child-process side of the delta link tests: a gloo receiver that reports what it rebuilt."""

from __future__ import annotations

from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from lightning_wsync._control.manifest import Manifest, build_manifest, checksum
from lightning_wsync._planes.delta.wire import Held, held_of, recv_records
from lightning_wsync._planes.wire import make_group


def sums(layout: Manifest, buffer: torch.Tensor) -> list[int]:
    return [checksum(buffer, a, b) for a, b in layout.buckets]


def versions(n_changed: int = 500) -> tuple[Manifest, torch.Tensor, torch.Tensor]:
    """A layout and two versions of it (``n_changed`` bf16 words apart); the same in every process."""
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(4096, 8, generator=g), "b": torch.randn(1000, generator=g), "c": torch.randn(50000)}
    layout = build_manifest(tensors, torch.bfloat16, 32 * 1024)
    base = torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8, generator=g)
    new = base.clone()
    idx = torch.randperm(layout.total_bytes // 2, generator=g)[:n_changed]
    new.view(torch.int16)[idx] += 1
    return layout, base, new


def receiver(port: int, helds: list[str], conn: Connection) -> None:
    """Receive one delta per entry of ``helds`` ("base", "old", "digest", "none"), then a marker."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30))
    pg = make_group("gloo", dist.PrefixStore("t/", store), 1, "127.0.0.1", 30)
    layout, base, new = versions()
    right = held_of(1, sums(layout, base))
    for kind in helds:
        held = {"base": right, "old": Held(0, right.digest), "digest": Held(1, 12345), "none": None}[kind]
        buffer = base.clone()
        got = recv_records(pg, layout, held=held, base=buffer, out=buffer)
        conn.send({"error": got.error, "sums": got.sums, "is_new": torch.equal(buffer, new),
                   "is_base": torch.equal(buffer, base), "wire_bytes": got.stats.wire_bytes,
                   "changed_share": got.stats.changed_share})  # fmt: skip
    marker = torch.empty(1, dtype=torch.int64)
    pg.recv([marker], 0, 0).wait()
    conn.send(int(marker[0]))


def delta_sender(port: int, job: str, spec: tuple[str, int], results: Any) -> None:
    """Join the store, push versions 1 and 2 over gloo (2 as a delta), report their digests, idle until killed."""
    import threading

    from _workers import build, digest, sparse_change

    from lightning_wsync import WeightSender

    torch.set_num_threads(1)
    model = build(spec)
    sender = WeightSender(model, store=f"127.0.0.1:{port}", job=job, transport="gloo", bucket_mb=2, timeout_s=10,
                          delta="always")  # fmt: skip
    for version in (1, 2):
        sparse_change(model, version)
        report = sender.push(version).wait(timeout_s=60)
        results.put(("pushed", "sender", version, digest(model), report.delta_receivers))
    threading.Event().wait()
