"""GPU figures: a CUDA module pushed through host shared memory, against the copies it is made of.

    lightning-wsync bench --gpu [--size-mb 1024] [--pushes 5] [--json]

Measures on one GPU (the paths that need two, NCCL pairs, are not here):

- the device-to-host copy bounds: into pageable memory, into pinned memory, into a
  ``/dev/shm`` mapping as the snapshot ring has it, and into the same mapping registered
  with CUDA (``cudaHostRegister``), which makes it a DMA target;
- ``WeightSender`` pushes of a CUDA module (float32, and cast to bfloat16 on the wire) to
  one receiver holding its module on the CPU and one holding it on the GPU: the trainer's
  stall, the latency until both applied, and a bit-exact digest check of every version;
- a Lightning ``Trainer`` on the GPU with ``WeightSyncCallback``, followed by a receiver
  process: the last version bit-exact.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_wsync.bench._push import wait_registered
from lightning_wsync.testing.models import build_model, digest, mutate, spec_for_size
from lightning_wsync.testing.stores import host_store

_CTX = mp.get_context("spawn")


def _timed(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bounds(nbytes: int, reps: int = 5) -> dict[str, float]:
    """GB/s of one device-to-host copy of ``nbytes`` into each kind of host memory."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="wsync-gpu-")
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)
    shm = torch.frombuffer(mm, dtype=torch.uint8)
    shm.fill_(1)
    out: dict[str, float] = {}
    out["pageable_gbs"] = nbytes / _timed(lambda: pageable.copy_(src), reps) / 1e9
    out["pinned_gbs"] = nbytes / _timed(lambda: pinned.copy_(src, non_blocking=True), reps) / 1e9
    out["shm_gbs"] = nbytes / _timed(lambda: shm.copy_(src), reps) / 1e9
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    t0 = time.perf_counter()
    err = cudart.cudaHostRegister(shm.data_ptr(), nbytes, 0)
    out["shm_register_s"] = time.perf_counter() - t0
    out["shm_register_error"] = int(err)
    out["shm_registered_is_pinned"] = bool(shm.is_pinned())
    if int(err) == 0:
        out["shm_registered_gbs"] = nbytes / _timed(lambda: shm.copy_(src, non_blocking=True), reps) / 1e9
        out["h2d_from_registered_gbs"] = nbytes / _timed(lambda: src.copy_(shm, non_blocking=True), reps) / 1e9
        cudart.cudaHostUnregister(shm.data_ptr())
    out["h2d_from_pageable_gbs"] = nbytes / _timed(lambda: src.copy_(pageable), reps) / 1e9
    out["h2d_from_pinned_gbs"] = nbytes / _timed(lambda: src.copy_(pinned, non_blocking=True), reps) / 1e9
    os.close(fd)
    os.unlink(path)  # the mapping goes with the tensor
    return out


def _receiver(address: str, job: str, name: str, size_mb: float, device: str, dtype: str | None, conn: Any) -> None:
    torch.set_num_threads(2)
    from lightning_wsync import WeightReceiver

    model = build_model(spec_for_size(size_mb), seed=None)
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    model = model.to(device)
    with WeightReceiver(model, store=address, job=job, name=name, timeout_s=120) as receiver:
        conn.send(("ready", name))
        want = 1
        while True:
            version = receiver.wait_for_version(want, timeout_s=300)
            _sync(device)
            applied_at = time.time()
            source = receiver._watcher.source
            plane = "" if source is None else source.describe()
            conn.send(("version", name, version, digest(model), applied_at, plane))
            if version < 0:
                return
            want = version + 1


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def push_run(
    size_mb: float, pushes: int, dtype: str | None, device: str = "cuda", transport: str = "auto",
    cuda_ipc: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Pushes of a ``device`` module to a CPU-module and a ``device``-module receiver, each checked bit-exact;
    with ``cuda_ipc`` the GPU receiver copies from the trainer's GPU slots."""
    from lightning_wsync import WeightSender

    spec = spec_for_size(size_mb)
    model = build_model(spec, seed=0).to(device)
    wire = None if dtype is None else getattr(torch, dtype)
    job = f"gpu-{os.getpid()}-{dtype}-{transport}-{cuda_ipc}"
    rows: list[dict[str, Any]] = []
    with WeightSender(model, store="127.0.0.1:0", job=job, dtype=dtype, transport=transport, timeout_s=120,
                      cuda_ipc=cuda_ipc) as sender:  # fmt: skip
        procs, conns = [], {}
        for name, where in (("cpu", "cpu"), ("dev", device)):
            ours, theirs = _CTX.Pipe()
            p = _CTX.Process(target=_receiver, args=(sender.store_address, job, name, size_mb, where, dtype, theirs))
            p.start()
            procs.append(p)
            conns[name] = ours
        try:
            for conn in conns.values():
                assert conn.poll(300) and conn.recv()[0] == "ready"
            wait_registered(sender, list(conns), 120)
            for version in range(1, pushes + 3):
                mutate(model, version)
                _sync(device)
                t0, wall0 = time.perf_counter(), time.time()
                handle = sender.push(version)
                stall = time.perf_counter() - t0
                report = handle.wait(120)
                latency = time.perf_counter() - t0
                want = digest(model, wire)
                got = {n: _next_version(c, version) for n, c in conns.items()}
                rows.append({
                    "version": version, "warmup": version <= 2, "stall_s": stall, "core_stall_s": handle.stall_s,
                    "latency_s": latency, "delivered": sorted(report.delivered),
                    "bit_exact": {n: g[3] == want for n, g in got.items()},
                    "applied_after_s": {n: g[4] - wall0 for n, g in got.items()},
                    "plane": {n: g[5] for n, g in got.items()},
                })  # fmt: skip
        finally:
            for p in procs:
                p.kill()
                p.join(10)
    timed = [r for r in rows if not r["warmup"]]
    return {
        "size_mb": size_mb, "pushed_bytes": sender.layout.total_bytes, "dtype": dtype or "float32",
        "transport": transport,
        "stall_s_median": statistics.median(r["stall_s"] for r in timed),
        "latency_s_median": statistics.median(r["latency_s"] for r in timed),
        "gpu_receiver_applied_s_median": statistics.median(r["applied_after_s"]["dev"] for r in timed),
        "cpu_receiver_applied_s_median": statistics.median(r["applied_after_s"]["cpu"] for r in timed),
        "planes": rows[-1]["plane"], "cuda_ipc": cuda_ipc,
        "all_bit_exact": all(all(r["bit_exact"].values()) for r in rows),
        "all_delivered": all(r["delivered"] == ["cpu", "dev"] for r in rows), "pushes": rows,
    }  # fmt: skip


def _next_version(conn: Any, version: int) -> tuple[Any, ...]:
    """The receiver's report of ``version``: ("version", name, version, digest, applied_at, plane)."""
    while True:
        if not conn.poll(300):
            raise TimeoutError(f"no report of version {version}")
        msg = conn.recv()
        if msg[0] == "version" and msg[2] == version:
            return tuple(msg)


class _Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def _lightning_receiver(address: str, job: str, steps: int, conn: Any) -> None:
    from lightning_wsync import WeightReceiver

    policy = _Policy()
    with WeightReceiver(policy, store=address, job=job, name="follower", timeout_s=60) as receiver:
        conn.send(("ready",))
        version = receiver.wait_for_version(steps, timeout_s=300)
        conn.send(("version", version, digest(policy)))


def lightning_run(steps: int = 8, every: int = 2, accelerator: str = "gpu") -> dict[str, Any]:
    """A Lightning Trainer on the GPU pushing every ``every`` steps; the receiver's last version bit-exact."""
    import lightning.pytorch as pl

    from lightning_wsync.callback import WeightSyncCallback
    from lightning_wsync.testing.trainers import trainer_kwargs

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.policy = _Policy()

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            loss: torch.Tensor = ((self.policy.net(batch[0]) - batch[1]) ** 2).mean()
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    port = _free_port()
    server = host_store("127.0.0.1", port, timeout_s=30)
    address, job = f"127.0.0.1:{port}", "gpu-lightning"
    ours, theirs = _CTX.Pipe()
    p = _CTX.Process(target=_lightning_receiver, args=(address, job, steps, theirs))
    p.start()
    try:
        assert ours.poll(300) and ours.recv()[0] == "ready"
        x = torch.randn(256, 64)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.flip(1)), batch_size=16)
        module = Module()
        cb = WeightSyncCallback(every_n_steps=every, module="policy", store=address, job=job)
        trainer = pl.Trainer(
            **trainer_kwargs(tempfile.mkdtemp(), accelerator=accelerator, max_steps=steps, callbacks=[cb])
        )
        trainer.fit(module, train_dataloaders=data)
        assert ours.poll(300)
        _, version, got = ours.recv()
        return {"version": version, "want": steps, "bit_exact": got == digest(module.policy.cpu())}
    finally:
        p.kill()
        p.join(10)
        del server


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--gpu`` and ``--device`` of ``lightning-wsync bench``."""
    parser.add_argument(
        "--gpu", action="store_true",
        help="a CUDA module on one GPU: copy bounds, pushes to CPU and GPU receivers, a Lightning run",
    )  # fmt: skip
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda",
        help="with --gpu: where the module lives (cpu: the same pushes without a GPU, a baseline)",
    )  # fmt: skip


def run_gpu(size_mb: float, pushes: int, *, device: str = "cuda", as_json: bool = False) -> int:
    """Every part in turn, each printed as it ends; the whole as one JSON object with ``as_json``."""
    if device == "cuda" and not torch.cuda.is_available():
        print("lightning-wsync bench --gpu: no CUDA device here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result: dict[str, Any] = {"device": name, "torch": torch.__version__}
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "push": lambda: push_run(size_mb, pushes, None, device),
        "push-bf16": lambda: push_run(size_mb, pushes, "bfloat16", device),
        "push-gloo": lambda: push_run(size_mb, pushes, None, device, transport="gloo"),
        "lightning": lambda: lightning_run(accelerator="gpu" if device == "cuda" else "cpu"),
    }
    if device == "cuda":
        steps = {"bounds": lambda: copy_bounds(spec_for_size(size_mb).nbytes), **steps,
                 "push-ipc": lambda: push_run(size_mb, pushes, None, device, cuda_ipc=True),
                 "push-bf16-ipc": lambda: push_run(size_mb, pushes, "bfloat16", device, cuda_ipc=True)}  # fmt: skip
    for part, step in steps.items():
        t0 = time.perf_counter()
        try:
            result[part] = step()
        except Exception as exc:  # a figure per part: one failure must not hide the others
            result[part] = {"error": f"{type(exc).__name__}: {exc}"}
        result[part]["run_s"] = round(time.perf_counter() - t0, 2)
        print(part, json.dumps({k: v for k, v in result[part].items() if k != "pushes"}), flush=True)
    if as_json:
        print(json.dumps(result))
    return 0 if not any("error" in v for v in result.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    raise SystemExit(run_gpu(1024, 5, as_json=True))
