"""A fleet member in a child process, driven by its parent over a pipe (tests/reliability/test_fleet.py)."""

from __future__ import annotations

from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import torch
import xxhash
from _workers import digest, mixed_model

from lightning_wsync.testing.procs import init_child, report_failure


class _Digests:
    """An apply target that keeps the digest of the last version handed to it (names sorted)."""

    def __init__(self) -> None:
        self.digest = ""

    def __call__(self, tensors: Mapping[str, torch.Tensor], version: int, /) -> None:
        h = xxhash.xxh3_128()
        for name in sorted(tensors):
            h.update(name.encode())
            h.update(tensors[name].contiguous().view(torch.uint8).numpy().data)
        self.digest = h.hexdigest()


def fleet_member_main(
    conn: Connection, store: str, job: str, name: str, options: dict[str, Any], kind: str = "module"
) -> None:
    """Join ``job`` as a receiver (of a module, or with ``kind="target"`` an apply target); on
    "update" call ``update()`` and answer (version, digest of what it holds)."""
    init_child()
    from lightning_wsync import WeightReceiver

    module = mixed_model(7)
    target = _Digests()
    try:
        with WeightReceiver(
            module if kind == "module" else target, store=store, job=job, name=name, **options
        ) as receiver:
            conn.send(("ready", receiver.rid))
            while conn.poll(120):
                command = conn.recv()
                if command == "update":
                    receiver.update()
                    conn.send(("version", receiver.version, digest(module) if kind == "module" else target.digest))
                elif command == "switches":
                    conn.send(("switches", [(s.version, s.rids) for s in receiver.fleet_switches]))
                else:
                    return
    except Exception:  # noqa: BLE001 - the parent shows it
        report_failure(conn, f"fleet member {name}")
