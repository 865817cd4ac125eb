"""Tensor-parallel engines load one version in every worker or none (no vLLM needed).

The workers are :class:`WsyncWorkerExtension` objects with real receivers on a real
store and shared memory; only vLLM's worker (``rank``, ``reload_weights``) and its
``collective_rpc`` are stood in for, so a push can land exactly between two workers'
steps and a worker can fall behind on purpose.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from _workers import build, digest, mutate
from torch import nn

from lightning_wsync import WeightSender, WeightSyncError, WeightSyncTimeoutError
from lightning_wsync.engines.vllm import VllmWeightSync, WsyncWorkerExtension

pytestmark = pytest.mark.timeout(120)


class FakeWorker(WsyncWorkerExtension):
    """vLLM's worker as the extension sees it: a rank and a reload into its model."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.model = build(("mixed", 1))
        self.loads: list[dict[str, torch.Tensor]] = []
        self.behind = False  # stages nothing newer than it holds, as a worker too slow to copy
        self.fail_start = False

    def reload_weights(self, *, weights_iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = {k: v.clone() for k, v in weights_iterator}
        self.loads.append(weights)
        self.model.load_state_dict(weights)

    def wsync_start(self, store: str | None, job: str | None, options: dict[str, Any]) -> str:
        if self.fail_start:
            raise WeightSyncError("this worker's receiver could not start")
        return super().wsync_start(store, job, options)

    def _wsync_check_names(self, name: str, staged: Any) -> None:
        pass  # needs vLLM's model classes: tested with a real engine in test_vllm_names.py

    def wsync_stage(self, min_version: int | None, timeout_s: float) -> dict[str, Any]:
        if not self.behind:
            return super().wsync_stage(min_version, timeout_s)
        staged = self._wsync_staged
        assert staged is not None
        if min_version is None:  # no update: keeps the version it had
            return {"version": staged.version}
        return super().wsync_stage(10**9, timeout_s)  # a version it cannot stage in time


class FakeEngine:
    """``vllm.LLM``'s ``collective_rpc`` over in-process workers, with a hook between workers."""

    def __init__(self, n: int) -> None:
        self.workers = [FakeWorker(rank) for rank in range(n)]
        self.between: Callable[[], None] | None = None  # runs once, after worker 0's next call
        self.resets = 0

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] = ()) -> list[Any]:
        results = []
        for w in self.workers:
            results.append(getattr(w, method)(*args))
            hook, self.between = self.between, None
            if hook is not None:
                hook()
        return results

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True


@contextmanager
def engine_at_version_0(port: int, timeout_s: float) -> Iterator[tuple[nn.Module, FakeEngine, Any, VllmWeightSync]]:
    """A trainer module, a 2-worker engine, its sender and sync; version 0 loaded everywhere."""
    src, engine = build(("mixed", 0)), FakeEngine(2)
    store = f"127.0.0.1:{port}"
    with (
        WeightSender(src, store=store, job="tp", timeout_s=10) as sender,
        VllmWeightSync(engine, store=store, job="tp", name="engine", timeout_s=timeout_s) as sync,
    ):
        assert sync.names == ["engine-w0", "engine-w1"]
        sender.push(0)
        assert sync.wait_for_version(0) == 0
        yield src, engine, sender, sync


def test_a_receiver_that_cannot_start_in_one_worker_is_stopped_in_all(port):
    engine = FakeEngine(2)
    engine.workers[1].fail_start = True
    with WeightSender(build(("mixed", 0)), store=f"127.0.0.1:{port}", job="tp-start", timeout_s=10):
        with pytest.raises(WeightSyncError, match="VllmWeightSync: could not start a receiver in the engine's workers"):
            VllmWeightSync(engine, store=f"127.0.0.1:{port}", job="tp-start", timeout_s=10)
    assert [w._wsync_receiver for w in engine.workers] == [None, None]  # worker 0's was closed (no thread left)


def test_a_push_between_two_workers_stages_never_leaves_the_engine_mixed(port):
    with engine_at_version_0(port, timeout_s=10) as (src, engine, sender, sync):
        mutate(src, 1)
        sender.push(1)
        mutate(src, 2)
        engine.between = lambda: sender.push(2)  # lands after worker 0 took version 1
        assert sync.update() == 2
        assert sync.version == 2 and [s["version"] for s in sync.state()] == [2, 2]
        assert [len(w.loads) for w in engine.workers] == [2, 2], "a worker loaded a version the other never did"
        assert [digest(w.model) for w in engine.workers] == [digest(src)] * 2
        assert engine.resets == 2  # once per version the engine moved to
        assert sync.update() is None and engine.resets == 2


def test_a_worker_that_cannot_stage_leaves_every_worker_on_the_previous_version(port):
    with engine_at_version_0(port, timeout_s=3.0) as (src, engine, sender, sync):
        v0 = digest(src)
        mutate(src, 1)
        sender.push(1)
        engine.workers[1].behind = True
        with pytest.raises(
            WeightSyncTimeoutError,
            match=r"engine workers \['engine-w1'\] did not stage version 1 within timeout_s=3.0 .*"
            r"no worker loaded it, the engine keeps its previous version everywhere",
        ):
            sync.update()
        assert sync.version == 0 and [s["version"] for s in sync.state()] == [0, 0]
        assert [digest(w.model) for w in engine.workers] == [v0, v0]
        assert [len(w.loads) for w in engine.workers] == [1, 1] and engine.resets == 1

        engine.workers[1].behind = False  # caught up: the next update loads version 1 everywhere
        assert sync.update() == 1
        assert [digest(w.model) for w in engine.workers] == [digest(src)] * 2
