"""A bench receiver process: a real WeightReceiver that reports each applied version.

``receiver_main`` loops on ``wait_for_version`` and, once a version is *applied* to its
module, sends the moment (``time.monotonic()``, one clock for the host) and its memory
growth through its pipe; when the parent asks (once every receiver has applied), it
hashes its module for the bit-exactness check. ``receiver_on_host`` runs the same on a
simulated host.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import NamedTuple

import torch
from torch import nn

from lightning_wsync import WeightReceiver, WeightSyncClosedError
from lightning_wsync.bench._memory import MemSample, growth, reset_peak
from lightning_wsync.testing.models import ModelSpec, build_model, digest
from lightning_wsync.testing.procs import BenchError, init_child, report_failure


def receiver_model(spec: ModelSpec, wire: str | None) -> tuple[nn.Module, torch.dtype | None]:
    """A receiver's module, held in the wire dtype as bf16 inference engines hold theirs."""
    model = build_model(spec, seed=None)
    wire_dtype = None if wire is None else getattr(torch, wire)
    return (model if wire_dtype is None else model.to(wire_dtype)), wire_dtype


class ReceiverArgs(NamedTuple):
    """What a bench receiver process is started with."""

    store: str
    job: str
    name: str
    spec: ModelSpec
    wire: str | None
    apply: str
    timeout_s: float


class ReceiverChild(NamedTuple):
    model: nn.Module
    wire_dtype: torch.dtype | None
    receiver: WeightReceiver
    memory: MemSample  # taken once the model was built: what the receiver itself adds grows from here


@contextmanager
def receiver_child(conn: Connection, args: ReceiverArgs) -> Iterator[ReceiverChild]:
    """A bench receiver process: its model and its receiver (``ready`` sent to the parent);
    a failure inside is reported to the parent, which raises it."""
    init_child()
    try:
        model, wire_dtype = receiver_model(args.spec, args.wire)
        memory = reset_peak()
        with WeightReceiver(
            model, store=args.store, job=args.job, name=args.name, timeout_s=args.timeout_s, apply=args.apply
        ) as receiver:
            conn.send(("ready", os.getpid()))
            yield ReceiverChild(model, wire_dtype, receiver, memory)
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        report_failure(conn, f"receiver {args.name}")


def receiver_main(conn: Connection, args: ReceiverArgs) -> None:
    with receiver_child(conn, args) as child:
        want = 0
        while True:
            try:
                version = child.receiver.wait_for_version(want, timeout_s=args.timeout_s)
            except WeightSyncClosedError:
                break
            applied_at = time.monotonic()
            conn.send(("applied", version, applied_at, growth(child.memory).to_json()))
            # Hash only once every receiver has applied: hashing now would steal CPU from
            # receivers still copying and inflate the latency being measured.
            if not conn.poll(args.timeout_s) or conn.recv() != ("digest",):
                raise BenchError(f"bench: receiver {args.name} got no digest request for version {version}")
            conn.send(("digest", version, digest(child.model, child.wire_dtype)))
            want = version + 1
    conn.send(("closed",))  # after the receiver closed (after an error report too: the parent raised already)


class Placement(NamedTuple):
    """Where a receiver runs: a simulated host's network namespace and its host identity."""

    name: str
    netns: str
    host_id: str


def receiver_on_host(conn: Connection, netns: str, host_id: str, args: ReceiverArgs) -> None:
    from lightning_wsync.testing.hosts import assume_host, enter_netns

    assume_host(host_id)
    enter_netns(netns)  # before any socket: the receiver's store client and links live there
    receiver_main(conn, args)
