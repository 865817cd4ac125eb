"""The apply seam: a receiver hands complete, verified versions to a callable target."""

from __future__ import annotations

import time
from collections.abc import Mapping

import pytest
import torch
from _workers import build, corrupt_newest_slot, digest, mutate

from lightning_wsync import WeightReceiver, WeightSender, WeightSyncError
from lightning_wsync.engines import ApplyTarget

pytestmark = pytest.mark.timeout(120)


class Recorder:
    """An ApplyTarget that loads every version into its own module (like an engine's loader)."""

    def __init__(self, module: torch.nn.Module, fail_on: int | None = None) -> None:
        self.module = module
        self.calls: list[int] = []
        self.fail_on = fail_on

    def __call__(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        self.calls.append(version)
        if version == self.fail_on:
            self.fail_on = None
            raise RuntimeError("engine busy")
        self.module.load_state_dict(dict(tensors))


def test_target_gets_each_applied_version_bit_exact(port):
    src, dst = build(("mixed", 0)), build(("mixed", 1))
    target: ApplyTarget = Recorder(dst)
    store = f"127.0.0.1:{port}"
    with (
        WeightSender(src, store=store, job="target", timeout_s=10) as sender,
        WeightReceiver(target, store=store, job="target", name="engine") as receiver,
    ):
            for version in (1, 2):
                mutate(src, version)
                handle = sender.push(version)
                assert receiver.wait_for_version(version, timeout_s=10) == version
                assert handle.wait(10).delivered == ("engine",)
                assert receiver.version == version and digest(dst) == digest(src)
            assert receiver.update() is None  # nothing newer: the target is not called again
            assert isinstance(target, Recorder) and target.calls == [1, 2]


def test_failing_target_leaves_no_version_and_the_next_update_hands_over_again(port):
    src, dst = build(("mixed", 0)), build(("mixed", 1))
    target = Recorder(dst, fail_on=2)
    store = f"127.0.0.1:{port}"
    with (
        WeightSender(src, store=store, job="target-fail", timeout_s=10) as sender,
        WeightReceiver(target, store=store, job="target-fail", name="engine") as receiver,
    ):
            mutate(src, 1)
            sender.push(1)
            assert receiver.wait_for_version(1, timeout_s=10) == 1
            mutate(src, 2)
            sender.push(2)
            message = r"'engine': the apply target raised on version 2 \(RuntimeError: engine busy\); it held 1"
            with pytest.raises(WeightSyncError, match=message):
                receiver.wait_for_version(2, timeout_s=10)
            assert receiver.version is None
            assert receiver.update() == 2 and digest(dst) == digest(src)
            assert target.calls == [1, 2, 2]


def test_corrupted_version_never_reaches_the_target(port):
    src, dst = build(("mixed", 0)), build(("mixed", 1))
    target = Recorder(dst)
    store = f"127.0.0.1:{port}"
    with (
        WeightSender(src, store=store, job="target-verify", timeout_s=10) as sender,
        WeightReceiver(target, store=store, job="target-verify", name="engine", verify=True) as receiver,
    ):
            mutate(src, 1)
            sender.push(1)
            assert receiver.wait_for_version(1, timeout_s=10) == 1
            held = digest(dst)
            mutate(src, 2)
            sender.push(2)
            deadline = time.monotonic() + 10
            corrupt_newest_slot(sender, "target-verify", 2, deadline)  # a bit flips after the snapshot
            while receiver.rejected == 0:
                assert time.monotonic() < deadline, "the corrupted version was never checked"
                assert receiver.update() is None
                time.sleep(0.005)
            assert receiver.version == 1 and digest(dst) == held and target.calls == [1]


def test_neither_module_nor_callable_is_refused():
    with pytest.raises(TypeError, match=r"module=42 is neither an nn.Module nor a callable ApplyTarget"):
        WeightReceiver(42, store="127.0.0.1:1", job="x")  # type: ignore[arg-type]


def test_vllm_engine_module_imports_without_vllm_and_names_the_extra():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; this checks the message without it")
    from lightning_wsync.engines import vllm as engine

    assert engine.WORKER_EXTENSION == "lightning_wsync.engines.vllm.WsyncWorkerExtension"
    with pytest.raises(ImportError, match=r"needs vLLM: pip install 'lightning-wsync\[vllm\]'"):
        engine.make_llm("model-dir")
