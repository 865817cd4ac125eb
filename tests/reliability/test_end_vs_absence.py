"""A fit() that raises is not the end of training: receivers keep following the job."""

from __future__ import annotations

import os
import queue
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_workers import PolicyModule, loader, make_policy
from _spawn import CTX

from lightning_wsync.callback import WeightSyncCallback
from lightning_wsync.testing.stores import host_store
from lightning_wsync.testing.trainers import trainer_kwargs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def rollout_loop_main(store: str, job: str, results: Any) -> None:
    """The README's rollout loop; reports versions applied and sender_left / sender_closed."""
    torch.set_num_threads(1)
    from lightning_wsync import WeightReceiver

    policy = make_policy()
    with WeightReceiver(policy, store=store, job=job, name="loop", timeout_s=30) as receiver:
        results.put(("ready", os.getpid()))
        left = False
        deadline = time.monotonic() + 120
        while not receiver.sender_closed and time.monotonic() < deadline:
            version = receiver.update()
            if version is not None:
                results.put(("version", version))
            if receiver.sender_left != left:
                left = receiver.sender_left
                results.put(("left" if left else "back", receiver.version))
            time.sleep(0.005)  # stands in for a rollout
        while (version := receiver.update()) is not None:
            results.put(("version", version))
        results.put(("end", receiver.version, receiver.sender_closed))


class _Failing(PolicyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 5:
            raise RuntimeError("boom at step 5")
        return super().training_step(batch, batch_idx)


def _next(results: Any, timeout_s: float) -> tuple[Any, ...]:
    try:
        msg: tuple[Any, ...] = results.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"no message from the rollout loop within {timeout_s} s") from None
    return msg


def _until(results: Any, kind: str, timeout_s: float) -> tuple[list[int], tuple[Any, ...]]:
    """Versions reported until the first ``kind`` message (an "end" before it fails)."""
    versions = []
    deadline = time.monotonic() + timeout_s
    while True:
        msg = _next(results, max(0.1, deadline - time.monotonic()))
        if msg[0] == kind:
            return versions, msg
        if msg[0] == "version":
            versions.append(msg[1])
        elif msg[0] == "end":
            raise AssertionError(f"the rollout loop ended (waiting for {kind!r}): {msg}, versions {versions}")


def test_raising_fit_leaves_receivers_following_and_relaunch_continues(tmp_path, port, children):
    server = host_store("127.0.0.1", port, timeout_s=30)
    store, job = f"127.0.0.1:{port}", "absent"
    results = CTX.Queue()
    proc = CTX.Process(target=rollout_loop_main, args=(store, job, results), daemon=True)
    proc.start()
    children.track(proc.pid)
    assert _next(results, 60)[0] == "ready"

    def fit(model: pl.LightningModule, max_steps: int) -> None:
        cb = WeightSyncCallback(every_n_steps=2, module="policy", store=store, job=job, max_version_lag=0)
        trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=max_steps, logger=False, callbacks=[cb]))
        trainer.fit(model, train_dataloaders=loader())

    with pytest.raises(RuntimeError, match="boom at step 5"):
        fit(_Failing(), max_steps=20)
    versions, left = _until(results, "left", 30)
    assert versions[-1] == 4 and left[1] == 4  # max_version_lag=0: 4 was applied before step 5 raised
    assert proc.is_alive()

    # The relaunched trainer starts from step 0: versions continue above 4, same receiver.
    fit(PolicyModule(), max_steps=8)
    versions, _ = _until(results, "back", 30)
    versions2, end = _until(results, "end", 30)
    assert sorted(set(versions + versions2)) == [6, 8]
    assert end == ("end", 8, True)  # the completed fit() ended training: sender_closed
    proc.join(timeout=30)
    assert proc.exitcode == 0
    del server
