"""A small LightningModule, a rollout receiver and a 2-rank trainer script.

Run as a script, it is the trainer of the multi-process tests (Lightning relaunches it
once per rank)::

    python tests/support/_lightning_workers.py --strategy ddp --store 127.0.0.1:PORT --job J --out DIR
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_wsync.testing.models import digest
from lightning_wsync.testing.trainers import RecordingLogger, trainer_kwargs

warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)


def make_policy() -> nn.Module:
    """Two layers with tied weights and an int64 buffer: ties and buffers must survive the trip."""
    policy = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    policy[2].weight = policy[0].weight
    policy.register_buffer("calls", torch.arange(3, dtype=torch.int64))
    return policy


class PolicyModule(pl.LightningModule):
    """A policy and a critic; ``shard=True`` applies FSDP2 to both in ``configure_model``."""

    def __init__(self, shard: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.policy = make_policy()
        self.critic = nn.Linear(8, 1)
        self.shard = shard

    def configure_model(self) -> None:
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.policy, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.critic, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.policy(x).pow(2).mean() + self.critic(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader(n: int = 256, batch_size: int = 4) -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g)), batch_size)


def _zeroed_policy() -> nn.Module:
    policy = make_policy()
    for t in policy.state_dict().values():
        t.detach().zero_()
    return policy


def _report(receiver: Any, name: str, policy: nn.Module, results: mp.Queue[Any]) -> None:
    """Report ("version", name, version, digest) for every version ``receiver`` applies, until the close."""
    from lightning_wsync import WeightSyncClosedError, WeightSyncError

    want = 0
    try:
        while True:
            try:
                version = receiver.wait_for_version(want, timeout_s=120)
            except WeightSyncClosedError:
                results.put(("closed", name, receiver.version))
                return
            results.put(("version", name, version, digest(policy)))
            want = version + 1
    except WeightSyncError as exc:
        results.put(("error", name, type(exc).__name__, str(exc)))


def receiver_main(store: str, job: str, name: str, results: mp.Queue[Any], verify: bool = False) -> None:
    """Follow the job; report ("version", name, version, digest) for every version applied."""
    torch.set_num_threads(1)
    from lightning_wsync import WeightReceiver, WeightSyncError

    policy = _zeroed_policy()
    try:
        with WeightReceiver(policy, store=store, job=job, name=name, timeout_s=60, verify=verify) as receiver:
            results.put(("ready", name, os.getpid()))
            _report(receiver, name, policy, results)
    except WeightSyncError as exc:
        results.put(("error", name, type(exc).__name__, str(exc)))


def receivers_main(
    store: str, job: str, hosts: list[str | None], results: mp.Queue[Any], verify: bool = False,
    fleet: str | None = None,
) -> None:  # fmt: skip
    """One receiver per host id in ``hosts`` (named ``r<i>``; None: this machine's own host id), all in
    this process (one torch import for all: at this machine's usual load each process takes minutes to
    start), each followed by a thread that reports as :func:`receiver_main` does; with ``fleet``, all in
    that fleet group."""
    import contextlib
    import threading

    torch.set_num_threads(1)
    from lightning_wsync import WeightReceiver

    with contextlib.ExitStack() as stack:
        threads = []
        for i, host in enumerate(hosts):
            if host is None:
                os.environ.pop("WSYNC_HOST_ID", None)
            else:
                os.environ["WSYNC_HOST_ID"] = host  # read as each receiver starts
            policy = _zeroed_policy()
            receiver = stack.enter_context(WeightReceiver(policy, store=store, job=job, name=f"r{i}", timeout_s=60,
                                                          verify=verify, fleet=fleet))  # fmt: skip
            threads.append(threading.Thread(target=_report, args=(receiver, f"r{i}", policy, results),
                                            name=f"follow-r{i}"))  # fmt: skip
        for i, thread in enumerate(threads):
            results.put(("ready", f"r{i}", os.getpid()))
            thread.start()
        for thread in threads:
            thread.join()


def next_message(results: mp.Queue[Any], kind: str, timeout_s: float) -> tuple[Any, ...]:
    """The next message of ``kind``; a receiver's error fails the test."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"no {kind!r} message within {timeout_s} s")
        try:
            msg: tuple[Any, ...] = results.get(timeout=remaining)
        except queue.Empty:
            continue
        if msg[0] == "error":
            raise AssertionError(f"receiver failed: {msg}")
        if msg[0] == kind:
            return msg


class _Probe(pl.Callback):
    """Placed after WeightSyncCallback: records whether this rank sends, and the full weights
    (a digest) at every version pushed, written to ``digests.jsonl`` by rank 0 as they come."""

    def __init__(self, sync: Any, out: str | None = None) -> None:
        self.sync = sync
        self.had_sender = False
        self.digest: str | None = None
        self.digests: dict[int, str] = {}
        self._out = out
        self._seen: int | None = None
        self.share: dict[str, Any] | None = None  # sharded push: what this rank snapshots

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._out is not None:  # the path each rank took, written before any push (a killed run has it too)
            chosen = {"sharded_push": self.sync.sharded_push, "unsharded_reason": self.sync.unsharded_reason}
            Path(self._out, f"start{trainer.global_rank}.json").write_text(json.dumps(chosen))
        self._record(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.had_sender = self.had_sender or self.sync.sender is not None
        shares = self.sync._shares
        if shares is not None and self.share is None:
            names = [e.name for e in shares.layout.entries]
            self.share = {
                "bytes": shares.share.total_bytes, "full_bytes": shares.layout.total_bytes,
                "pieces": [[names[p.entry], p.start, p.end] for p in shares.plan.shares[shares.rank]],
            }  # fmt: skip
        self._record(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.digest = self._full_digest(trainer, pl_module)
        self._record(trainer, pl_module, known=True)

    def _record(self, trainer: pl.Trainer, pl_module: pl.LightningModule, known: bool = False) -> None:
        version = self.sync.last_pushed_version  # the same on every rank: the collective below is safe
        if version is None or version == self._seen:
            return
        self._seen = version
        value = self.digest if known else self._full_digest(trainer, pl_module)
        if trainer.is_global_zero and value is not None:
            self.digests[version] = value
            if self._out is not None:
                with open(Path(self._out, "digests.jsonl"), "a") as f:
                    f.write(json.dumps([version, value]) + "\n")

    def _full_digest(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        assert isinstance(pl_module, PolicyModule)
        if not pl_module.shard:
            return digest(pl_module.policy)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(pl_module.policy, options=options)  # a collective
        if not trainer.is_global_zero:
            return None
        plain = make_policy()
        plain.load_state_dict(full)
        return digest(plain)


def _kill_mid_share(version: int) -> None:
    """Ranks other than 0 SIGKILL themselves halfway through writing their share of ``version``.

    Lightning's launcher (rank 0) looks for a dead child every 5 s and then SIGKILLs every rank:
    here every 60 s, so that rank 0 lives past its verdict on the version (``timeout_s``) and logs
    it; it then fails at its next collective with the dead rank."""
    import signal

    from lightning.fabric.strategies.launchers import subprocess_script

    from lightning_wsync._control.manifest import copy_tensors
    from lightning_wsync._planes import shares

    observer = subprocess_script._ChildProcessObserver
    observer_init = observer.__init__

    def slow_observer(self: Any, main_pid: int, child_processes: Any, sleep_period: int = 5) -> None:
        observer_init(self, main_pid, child_processes, sleep_period=60)

    observer.__init__ = slow_observer  # type: ignore[method-assign]

    original = shares.ShareWriter.write

    def write(self: Any, v: int, **kwargs: Any) -> bool:
        if v == version:
            ring = self._ring
            draft = ring.draft()  # the slot is marked as being written
            assert draft is not None
            half = len(self._shares.sources) // 2 or 1
            copy_tensors(ring._views[draft.slot][:half], self._shares.sources[:half])
            print(f"rank {self._shares.rank}: SIGKILL mid-share of version {v}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        result: bool = original(self, v, **kwargs)
        return result

    shares.ShareWriter.write = write  # type: ignore[method-assign]


def _fsdp(shards: int) -> Any:
    """Lightning's ModelParallelStrategy: with ``shards`` (2) FSDP2 splits every parameter over both
    ranks; with 0 ("auto") its data-parallel mesh has one rank, so each rank holds whole tensors."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if not shards:
        return ModelParallelStrategy()
    return ModelParallelStrategy(data_parallel_size=shards, tensor_parallel_size=1)


def _count_gathers() -> list[int]:
    """Count the callback's full-weights gathers (``get_model_state_dict``) in this rank."""
    from lightning_wsync import callback

    calls = [0]
    original = callback.get_model_state_dict

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    callback.get_model_state_dict = counted  # type: ignore[assignment]
    return calls


def main() -> None:
    from lightning_wsync.callback import WeightSyncCallback

    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--sharded", nargs="?", const="true", default="auto", choices=["auto", "true", "false"],
                        help="the callback's sharded= (default: its own default, 'auto'); bare: true")  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--cross-host", default=None, help="the callback's cross_host (default: its own)")
    parser.add_argument("--log-relay-shapes", action="store_true", help="each rank logs its relay's shapes (INFO)")
    parser.add_argument("--kill-share-at", type=int, default=None, help="rank 1 dies mid-share of this version")
    parser.add_argument("--fsdp-shards", type=int, default=0, help="FSDP2's data-parallel size (0: Lightning's auto)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.kill_share_at is not None:
        _kill_mid_share(args.kill_share_at)
    gathers = _count_gathers()
    if args.log_relay_shapes:  # "relay chain|trees N: [rids]", prefixed with the rank's pid
        import logging

        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("pid=%(process)d %(message)s"))
        relay_log = logging.getLogger("lightning_wsync._planes.relay.head.feed")
        relay_log.addHandler(handler)
        relay_log.setLevel(logging.INFO)

    sync = WeightSyncCallback(every_n_steps=args.every, module="policy", store=args.store, job=args.job,
                              max_version_lag=0, timeout_s=args.timeout_s,
                              **({} if args.cross_host is None else {"cross_host": args.cross_host}),
                              **({} if args.sharded == "auto" else {"sharded": args.sharded == "true"}))  # fmt: skip
    probe = _Probe(sync, args.out)
    logger = RecordingLogger()
    fsdp = args.strategy == "fsdp2"
    trainer = pl.Trainer(**trainer_kwargs(
        args.out, devices=2, strategy=_fsdp(args.fsdp_shards) if fsdp else "ddp", max_steps=args.max_steps,
        logger=logger, callbacks=[sync, probe],
    ))  # fmt: skip
    trainer.fit(PolicyModule(shard=fsdp), train_dataloaders=loader())
    record = {
        "rank": trainer.global_rank,
        "had_sender": probe.had_sender,
        "versions": [int(v) for v in logger.values("wsync/version")],
        "delivered": logger.values("wsync/delivered"),
        "failed": logger.values("wsync/failed"),
        "report_versions": [int(v) for v in logger.values("wsync/report_version")],
        "last_pushed": sync.last_pushed_version,
        "digest": probe.digest,
        "digests": {str(v): d for v, d in probe.digests.items()},
        "share": probe.share,
        "gathers": gathers[0],
        "sharded_push": sync.sharded_push,
        "unsharded_reason": sync.unsharded_reason,
    }
    Path(args.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _exit_without_finalizing() -> None:
    """End this rank without tearing the interpreter down: torch (2.13) gloo's worker threads free
    a finished collective's work after its waiter returned; when the work holds the last reference
    to a tensor whose Python object was already dropped (the probe's full gather on train end,
    right before exit), freeing it takes the GIL, and during interpreter finalization that thread
    is ended by pthread_exit through a noexcept destructor: std::terminate, exit -6 (seen in a
    core dump: ``~AsyncAllgatherCoalescedWork`` -> ``decref_pyobject`` -> ``PyThread_exit_thread``).
    Everything this script reports is written by now; an error above still exits non-zero."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    _exit_without_finalizing()
