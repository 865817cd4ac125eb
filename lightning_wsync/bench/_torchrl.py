"""``--compare torchrl``: TorchRL's ``DistributedWeightSyncScheme`` on the same model.

Drives the real scheme the way TorchRL's ``DistributedCollector`` does, minus the
environments: the trainer creates ``DistributedWeightSyncScheme(backend="gloo",
sync=True)`` and calls ``init_on_sender(model_id="policy", context=..., num_workers=N)``,
which starts the scheme's own TCPStore and one ``DistributedTransport`` per worker.
The scheme is pickled to N spawned workers (its ``__getstate__`` keeps only the
store's address); each calls ``init_on_receiver(model_id="policy", context=...,
worker_idx=rank)``, with a context whose ``policy`` is its module, as the collector
passes its inner collector. Trainer and workers then join one default gloo group of
N + 1 ranks (the collector creates it before the scheme does anything; so do we) and
call ``connect()``: the trainer sends the initial weights, each worker receives them,
loads them into its module and starts the scheme's receiver thread. A push is
``scheme.send()`` (weights extracted from the context's ``policy``): for every worker
it sets ``NODE_<rank>_in`` in the scheme's store and sends the weights ``TensorDict``
over gloo, then it waits for each worker's ``NODE_<rank>_out`` acknowledgement, which
the receiver thread writes after applying the weights to the module. ``send()``
therefore returns once every worker holds the push: its duration is both the
trainer's stall and the latency. After each push the workers report a digest of
their module, outside the timed region.

TorchRL is optional (``pip install lightning-wsync[torchrl]``); without it the
comparison is skipped with a message and the benchmark goes on.
"""

from __future__ import annotations

import importlib
import logging
import socket
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_wsync.bench._report import median
from lightning_wsync.testing.models import ModelSpec, build_model, digest, mutate
from lightning_wsync.testing.procs import BenchError, Children, init_child, receive, report_failure

log = logging.getLogger(__name__)

NOT_INSTALLED = "torchrl is not installed; `pip install lightning-wsync[torchrl]` to compare with it (skipped)"
_MODEL_ID = "policy"  # what TorchRL's collectors call the model a scheme syncs


class _Context:
    """What the scheme resolves ``model_id`` against: a collector, for TorchRL; here just the module.

    The scheme holds it by weak reference, so its owner keeps it alive.
    """

    def __init__(self, policy: nn.Module) -> None:
        self.policy = policy


def _weight_update() -> ModuleType | None:
    try:
        importlib.import_module("tensordict")
        return importlib.import_module("torchrl.weight_update")
    except ImportError:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join_group(port: int, rank: int, world: int, timeout_s: float) -> None:
    """The default gloo group the scheme sends over (TorchRL's collector creates it the same way)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip


def _worker_main(conn: Connection, scheme: Any, port: int, rank: int, world: int, spec: ModelSpec,
                 timeout_s: float) -> None:  # fmt: skip
    init_child()
    try:
        model = build_model(spec, seed=None)
        context = _Context(model)
        scheme.init_on_receiver(model_id=_MODEL_ID, context=context, worker_idx=rank)
        conn.send(("initialized",))
        _join_group(port, rank, world, timeout_s)
        scheme.connect()  # receives the initial weights, then starts the scheme's receiver thread
        conn.send(("ready", digest(model)))
        while True:  # pushes arrive on the scheme's own thread; this one only reports
            if not conn.poll(timeout_s):
                raise BenchError(f"no instruction from the trainer within {timeout_s:.0f} s")
            if conn.recv() != "digest":
                break
            conn.send(("digest", digest(model)))
        scheme.shutdown()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent
        report_failure(conn, f"torchrl worker rank {rank}")


def _timed_sends(
    scheme: Any, model: nn.Module, conns: list[Connection], pushes: int, timeout_s: float
) -> tuple[list[float], bool]:
    """Connect, then one warm-up and ``pushes`` timed ``send()`` calls; each send's seconds, and
    whether every worker held exactly the pushed weights each time."""
    scheme.connect()  # the initial weights, to every worker
    expected = digest(model)
    digests_ok = True
    for r, conn in enumerate(conns, start=1):
        msg = receive(conn, timeout_s, f"torchrl worker rank {r} to receive the initial weights")
        digests_ok = digests_ok and msg[1] == expected
    stalls: list[float] = []
    for version in range(1, pushes + 2):  # the first is a warm-up
        mutate(model, 100 + version)
        expected = digest(model)
        started = time.monotonic()
        scheme.send()  # returns once every worker has acknowledged the applied weights
        elapsed = time.monotonic() - started
        for conn in conns:
            conn.send("digest")
        for r, conn in enumerate(conns, start=1):
            msg = receive(conn, timeout_s, f"torchrl worker rank {r} to report its weights")
            digests_ok = digests_ok and msg[1] == expected
        if version > 1:
            stalls.append(elapsed)
    scheme._send_instruction("stop")  # the scheme's own stop for its receiver threads
    for conn in conns:
        conn.send("stop")
    for conn in conns:
        conn.poll(timeout_s)  # the worker exits; its pipe closes
    return stalls, digests_ok


def compare_torchrl(
    model: nn.Module, spec: ModelSpec, *, n_receivers: int, pushes: int, timeout_s: float
) -> dict[str, object]:
    """Median stall and latency of TorchRL's distributed scheme; ``{"skipped": why}`` if it cannot run."""
    weight_update = _weight_update()
    if weight_update is None:
        return {"skipped": NOT_INSTALLED}
    if dist.is_initialized():
        return {"skipped": "a default process group already exists in this process; run the comparison alone"}
    port, world = _free_port(), n_receivers + 1
    context = _Context(model)
    scheme: Any = None
    try:
        scheme = weight_update.DistributedWeightSyncScheme(backend="gloo", sync=True, timeout=timeout_s)
        scheme.init_on_sender(model_id=_MODEL_ID, context=context, num_workers=n_receivers)
        with Children() as children:
            conns = [
                children.start(_worker_main, (scheme, port, r, world, spec, timeout_s), name=f"wsync-bench-torchrl-{r}")
                for r in range(1, world)
            ]
            for r, conn in enumerate(conns, start=1):
                receive(conn, timeout_s, f"torchrl worker rank {r} to initialize its scheme")
            _join_group(port, 0, world, timeout_s)
            try:
                stalls, digests_ok = _timed_sends(scheme, model, conns, pushes, timeout_s)
            finally:
                dist.destroy_process_group()
    except (BenchError, RuntimeError, TypeError, AttributeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return {"skipped": f"torchrl comparison failed ({type(exc).__name__}: {first}); torchrl's API may have changed"}
    finally:
        if scheme is not None:
            scheme.shutdown()
    result: dict[str, object] = {
        "method": "torchrl.weight_update.DistributedWeightSyncScheme (gloo, sync): "
        "send() to all workers, then their acks",
        "stall_s": median(stalls),
        "latency_s": median(stalls),  # send() returns only once every worker has applied the push
        "stall_samples_s": stalls,
        "latency_samples_s": list(stalls),
        "digests_ok": digests_ok,
    }
    if not digests_ok:
        result["skipped"] = (
            f"torchrl comparison failed: a worker's weights differ from the pushed ones "
            f"(median push {median(stalls):.4f} s)"
        )
    return result
