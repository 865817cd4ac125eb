"""The trainer of ``lightning-wsync bench --trainer-ranks``: Lightning on CPU (gloo), a
benchmark model pushed every step; each rank writes what it measured to ``rank<r>.json``.

Run by :mod:`lightning_wsync.bench._ranks` as ``python -m lightning_wsync.bench._ranks_trainer``;
Lightning starts the other ranks with the same command line.

Per push and per rank: the time the training loop spends in the push hook (the stall;
under DDP without sharding the other ranks then wait for rank 0 at the next collective,
so a push's stall is the slowest rank's), and how far the rank's peak resident memory
(VmHWM, reset before the hook) rose above what it held just before it: the push's own
memory (a gathered copy under FSDP2 unsharded; pages of the rings touched the first time).
Per rank, also the run's peak above what it held before the callback started.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_wsync import WeightSyncCallback
from lightning_wsync.bench._memory import MemSample, growth, reset_peak
from lightning_wsync.bench._threads import ThreadSampler, python_names, window
from lightning_wsync.testing.models import ModelSpec, build_model
from lightning_wsync.testing.trainers import RecordingLogger, trainer_kwargs

warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)


def _block_forward(b: Any, h: torch.Tensor) -> torch.Tensor:
    """One token through a block: every weight used, little arithmetic."""
    out: torch.Tensor = h + b.out(b.q(b.ln1(h)) + b.k(h) + b.v(h)) + b.fc2(b.fc1(b.ln2(h)))
    return out


def _policy_forward(p: Any, idx: torch.Tensor) -> torch.Tensor:
    h = p.tok(idx)
    for block in p.blocks:
        h = block(h)
    out: torch.Tensor = p.ln_f(h)
    return out


class _Policy(pl.LightningModule):
    def __init__(self, spec: ModelSpec, fsdp: bool) -> None:
        super().__init__()
        self.policy = build_model(spec, seed=0)
        # Called as modules, so FSDP2's hooks gather each one's weights around its forward.
        self.policy.forward = types.MethodType(_policy_forward, self.policy)
        for block in self.policy.blocks:
            block.forward = types.MethodType(_block_forward, block)
        self.fsdp = fsdp

    def configure_model(self) -> None:
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            assert self.device_mesh is not None  # ModelParallelStrategy sets it before configure_model
            mesh = self.device_mesh["data_parallel"]
            for block in self.policy.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.policy, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (idx,) = batch
        out: torch.Tensor = self.policy(idx)
        return out.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def _rss_kib() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in KiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


class _Before(pl.Callback):
    """Placed before WeightSyncCallback: the resident memory before it starts, and each push's start."""

    def __init__(self, profile: _Profile | None) -> None:
        self.started = 0.0
        self.cpu_started = 0.0
        self.rss_kib = 0
        self.memory: MemSample | None = None  # just before this push, with the peak reset
        self.profile = profile

    def on_fit_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.rss_kib = _rss_kib()[0]
        if self.profile is not None:
            self.profile.started(trainer.global_rank)

    def on_train_batch_end(self, *args: Any) -> None:
        if self.profile is not None:
            self.profile.enter()
        self.memory = reset_peak()
        self.started = time.perf_counter()
        self.cpu_started = time.thread_time()


class _After(pl.Callback):
    """Placed after WeightSyncCallback: each push's stall and its peak memory rise."""

    def __init__(self, before: _Before) -> None:
        self.before = before
        self.stall_s: list[float] = []
        self.cpu_s: list[float] = []  # the training thread's CPU time in the hook: what load does not inflate
        self.rise_mib: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.stall_s.append(time.perf_counter() - self.before.started)
        self.cpu_s.append(time.thread_time() - self.before.cpu_started)
        assert self.before.memory is not None
        self.rise_mib.append(growth(self.before.memory).peak_rss / 2**20)
        if self.before.profile is not None:
            self.before.profile.exit()


class _Profile:
    """``--profile-pids``: every bench thread sampled at each hook's entry and exit, outside the timed window
    (:mod:`~lightning_wsync.bench._threads`); this rank's pid is noted in ``out`` for the other ranks."""

    def __init__(self, pids: dict[str, int], out: str, ranks: int) -> None:
        self.pids, self.out, self.ranks = pids, out, ranks
        self.sampler: ThreadSampler | None = None
        self.entry: dict[str, Any] | None = None
        self.windows: list[dict[str, Any]] = []
        self.names: dict[int, str] = {}

    def started(self, rank: int) -> None:  # before the callback's first collective: all noted by the first push
        Path(self.out, f"pid{rank}").write_text(str(os.getpid()))

    def enter(self) -> None:
        if self.sampler is None:
            ranks = {f"rank{r}": int(Path(self.out, f"pid{r}").read_text()) for r in range(self.ranks)}
            self.sampler = ThreadSampler({**ranks, **self.pids})
        self.entry = self.sampler.sample()

    def exit(self) -> None:
        assert self.sampler is not None and self.entry is not None
        self.windows.append(window(self.entry, self.sampler.sample()))
        self.names.update(python_names())

    def record(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "threads": self.windows, "py_names": self.names,
                "comms": {} if self.sampler is None else self.sampler.comms}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--d-model", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), required=True)
    parser.add_argument("--sharded", choices=("auto", "true", "false"), default="auto",
                        help="the callback's sharded= (auto: its default)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--profile-pids", default=None,
                        help="role=pid,...: also sample every thread of these processes and of the ranks at each hook")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = ModelSpec(d_model=args.d_model, vocab=args.vocab)
    fsdp = args.strategy == "fsdp" and args.ranks > 1
    sync = WeightSyncCallback(every_n_steps=1, module="policy", store=args.store, job=args.job,
                              timeout_s=args.timeout_s,
                              **({} if args.sharded == "auto" else {"sharded": args.sharded == "true"}))  # fmt: skip
    profile = None
    if args.profile_pids is not None:
        pids = {role: int(pid) for role, pid in (item.split("=") for item in args.profile_pids.split(","))}
        profile = _Profile(pids, args.out, args.ranks)
    before = _Before(profile)
    after = _After(before)
    metrics = RecordingLogger()
    if args.ranks == 1:
        strategy: Any = "auto"
    elif fsdp:
        strategy = ModelParallelStrategy(data_parallel_size=args.ranks, tensor_parallel_size=1)
    else:
        strategy = "ddp"
    trainer = pl.Trainer(**trainer_kwargs(
        args.out, devices=args.ranks, strategy=strategy, max_steps=args.steps, logger=metrics,
        callbacks=[before, sync, after],
    ))  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.zeros(args.steps * args.ranks, 1, dtype=torch.long))
    trainer.fit(_Policy(spec, fsdp), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=1))
    record = {
        "rank": trainer.global_rank,
        "stall_s": after.stall_s,
        "cpu_s": after.cpu_s,
        "peak_rise_mib": (_rss_kib()[1] - before.rss_kib) / 1024,  # the run's peak over the memory before any push
        "push_rise_mib": after.rise_mib,
        "delivery_s": metrics.values("wsync/delivery_s"),
        "logged_stall_s": metrics.values("wsync/stall_s"),
        "sharded_push": sync.sharded_push,
        "unsharded_reason": sync.unsharded_reason,
        **({} if profile is None else {"profile": profile.record()}),
    }
    Path(args.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    # Not a normal interpreter exit: torch's gloo workers may free the final gather's work (and
    # its tensors' Python objects) only once the interpreter is finalizing, where taking the GIL
    # ends the thread inside a noexcept destructor: std::terminate (docs/sharded.md). The
    # results are written; an error above still exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
