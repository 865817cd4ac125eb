"""A trainer tensor the engine's model would not load is refused, named, before any version loads:
at start-up when the trainer published its layout first, else when the first version is staged.

Two ways a name fails with vLLM's Llama: one its loader raises on (no such module), and
one it skips without a word (an extra ``.bias``, which ``reload_weights`` would drop).
The trainer's other names are Hugging Face ones that vLLM fuses (q/k/v, gate/up): accepted.
"""

from __future__ import annotations

import _vllm_only  # noqa: F401  (first: skips without vLLM)
import pytest
import torch
from tiny_llama import write_tiny_llama

from lightning_wsync import WeightSender, WeightSyncSchemaError
from lightning_wsync.engines.vllm import VllmWeightSync, make_llm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_names_the_model_cannot_load_are_refused_before_the_first_version(tmp_path, port, server, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path = write_tiny_llama(tmp_path / "model")
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mlp = trainer.model.layers[0].mlp
    mlp.register_parameter("extra_scale", torch.nn.Parameter(torch.ones(4)))  # no such module in vLLM
    mlp.up_proj.bias = torch.nn.Parameter(torch.zeros(mlp.up_proj.out_features))  # vLLM skips it silently
    llm = make_llm(path, dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20)
    store = f"127.0.0.1:{port}"
    try:
        # The trainer up first (the usual order): refused at start-up, before any version.
        with WeightSender(trainer, store=store, job="names-first", timeout_s=30):
            with pytest.raises(WeightSyncSchemaError) as info:
                VllmWeightSync(llm, store=store, job="names-first", name="early", timeout_s=30)
            message = str(info.value)
            assert "start in worker 'early-w0'" in message
            assert "2 of the trainer's 23 tensors would not load" in message
            assert "model.layers.0.mlp.extra_scale (ValueError: There is no module or parameter" in message
            assert "model.layers.0.mlp.up_proj.bias (skipped by LlamaForCausalLM.load_weights)" in message
            assert llm.collective_rpc("wsync_close") == [None]  # the refused receiver was closed already

        # The engine up first: the names are checked when the first version is staged.
        with (
            VllmWeightSync(llm, store=store, job="names", name="engine", timeout_s=30) as sync,
            WeightSender(trainer, store=store, job="names", timeout_s=30) as sender,
        ):
            sender.push(0)
            with pytest.raises(WeightSyncSchemaError) as info:
                sync.wait_for_version(0)
            message = str(info.value)
            assert "stage in worker 'engine-w0'" in message
            assert "2 of the trainer's 23 tensors would not load" in message
            assert "model.layers.0.mlp.extra_scale (ValueError: There is no module or parameter" in message
            assert "model.layers.0.mlp.up_proj.bias (skipped by LlamaForCausalLM.load_weights)" in message
            assert "q_proj" not in message and "gate_proj" not in message  # fused names load
            assert sync.version is None and sync.state()[0]["version"] is None  # nothing was loaded
            with pytest.raises(WeightSyncSchemaError, match="extra_scale"):
                sync.update()  # the same names, refused again

        # Left out on both sides, the same trainer loads.
        skip = ["*extra_scale", "*.bias"]
        with (
            WeightSender(trainer, store=store, job="names-ok", timeout_s=30, exclude=skip) as sender,
            VllmWeightSync(llm, store=store, job="names-ok", timeout_s=30, exclude=skip) as sync,
        ):
            sender.push(0)
            assert sync.wait_for_version(0) == 0
    finally:
        llm.llm_engine.engine_core.shutdown()
