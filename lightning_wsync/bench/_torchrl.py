"""``--compare torchrl``: TorchRL's torch.distributed weight sync on the same model.

Runs the per-worker ``DistributedTransport`` that TorchRL's
``DistributedWeightSyncScheme`` creates (gloo, ``sync=True``), without a collector:
the trainer and N worker processes join one default gloo group of N + 1 ranks; each
push sets the worker's ``NODE_<rank>_in`` key, sends a ``TensorDict`` of the weights
and waits for the worker's ``NODE_<rank>_out`` acknowledgement, one worker after the
other, as the scheme does. Workers receive straight into a ``TensorDict`` that shares
storage with their module, so a received push is an applied one.

TorchRL is optional (``pip install lightning-wsync[torchrl]``); without it the
comparison is skipped with a message and the benchmark goes on.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_wsync.bench._model import ModelSpec, build_model, digest, mutate
from lightning_wsync.bench._procs import BenchError, Children, init_child, receive, report_failure
from lightning_wsync.bench._report import median

log = logging.getLogger(__name__)

NOT_INSTALLED = "torchrl is not installed; `pip install lightning-wsync[torchrl]` to compare with it (skipped)"


def _modules() -> tuple[ModuleType, ModuleType] | None:
    try:
        return importlib.import_module("torchrl.weight_update"), importlib.import_module("tensordict")
    except ImportError:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join_group(port: int, rank: int, world: int, timeout_s: float, is_master: bool) -> dist.TCPStore:
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master, timeout=timeout, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank, world_size=world, timeout=timeout)
    return store


def _weights(tensordict: ModuleType, model: nn.Module) -> Any:
    """A TensorDict sharing storage with ``model``'s parameters and buffers (no autograd)."""
    return tensordict.TensorDict.from_module(model).data


def _worker_main(conn: Connection, port: int, rank: int, world: int, spec: ModelSpec, timeout_s: float) -> None:
    init_child()
    try:
        modules = _modules()
        assert modules is not None, NOT_INSTALLED
        weight_update, tensordict = modules
        model = build_model(spec, seed=None)
        store = _join_group(port, rank, world, timeout_s, is_master=False)
        buffer = _weights(tensordict, model)
        transport = weight_update.DistributedTransport(weights_buffer=buffer, store=store, rank=rank, sync=True)
        conn.send(("ready", os.getpid()))
        key = f"NODE_{rank}_in"
        while True:
            store.wait([key], timedelta(seconds=timeout_s))
            instruction = store.get(key)
            store.delete_key(key)
            if instruction != b"update_weights":
                break
            transport.receive_weights()
            transport.send_ack("updated")
            conn.send(("applied", time.monotonic(), digest(model)))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent
        report_failure(conn, f"torchrl worker rank {rank}")


def compare_torchrl(
    model: nn.Module, spec: ModelSpec, *, n_receivers: int, pushes: int, timeout_s: float
) -> dict[str, object]:
    """Median stall and latency of TorchRL's distributed scheme; ``{"skipped": why}`` if it cannot run."""
    modules = _modules()
    if modules is None:
        return {"skipped": NOT_INSTALLED}
    if dist.is_initialized():
        return {"skipped": "a default process group already exists in this process; run the comparison alone"}
    weight_update, tensordict = modules
    port, world = _free_port(), n_receivers + 1
    try:
        with Children() as children:
            conns = [
                children.start(_worker_main, (port, r, world, spec, timeout_s), name=f"wsync-bench-torchrl-{r}")
                for r in range(1, world)
            ]
            store = _join_group(port, 0, world, timeout_s, is_master=True)
            try:
                for r, conn in enumerate(conns, start=1):
                    receive(conn, timeout_s, f"torchrl worker rank {r} to start")
                weights = _weights(tensordict, model)
                transports = [
                    weight_update.DistributedTransport(weights_buffer=weights, store=store, rank=r, sync=True)
                    for r in range(1, world)
                ]
                stalls: list[float] = []
                latencies: list[float] = []
                digests_ok = True
                for version in range(1, pushes + 2):  # the first is a warm-up
                    mutate(model, 100 + version)
                    expected = digest(model)
                    started = time.monotonic()
                    for transport in transports:  # what the scheme does for each worker
                        transport.send_weights(weights)
                    stall = time.monotonic() - started
                    applied = []
                    for r, conn in enumerate(conns, start=1):
                        msg = receive(conn, timeout_s, f"torchrl worker rank {r} to apply a push")
                        applied.append(float(msg[1]))  # type: ignore[arg-type]
                        digests_ok = digests_ok and msg[2] == expected
                    if version > 1:
                        stalls.append(stall)
                        latencies.append(max(applied) - started)
                for r in range(1, world):
                    store.set(f"NODE_{r}_in", "stop")
                for r, conn in enumerate(conns, start=1):
                    conn.poll(timeout_s)  # the worker exits; its pipe closes
            finally:
                dist.destroy_process_group()
    except (BenchError, RuntimeError, TypeError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return {"skipped": f"torchrl comparison failed ({type(exc).__name__}: {first}); torchrl's API may have changed"}
    return {
        "method": "torchrl.weight_update.DistributedTransport (gloo, sync), one worker after the other",
        "stall_s": median(stalls),
        "latency_s": median(latencies),
        "stall_samples_s": stalls,
        "latency_samples_s": latencies,
        "digests_ok": digests_ok,
    }
