"""vLLM's own ``update_weights`` with the ``wsync`` weight-transfer backend.

The trainer only pushes; the rollout side drives vLLM's RL API (init, start, update,
finish) and gets the newest verified version, greedy tokens equal to transformers'.
"""

from __future__ import annotations

import _vllm_only  # noqa: F401  (first: skips without vLLM)
import pytest
import torch
from test_vllm_engine import NEW_TOKENS, PROMPTS, hf_greedy, perturb
from tiny_llama import write_tiny_llama

from lightning_wsync import WeightSender
from lightning_wsync.engines.vllm import make_llm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_update_weights_loads_the_newest_verified_version(tmp_path, port, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path = write_tiny_llama(tmp_path / "model", init_std=0.5)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPTS[0]).input_ids
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = make_llm(path, dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20,
                   weight_transfer_config={"backend": "wsync"})  # fmt: skip
    store = f"127.0.0.1:{port}"
    try:
        with WeightSender(trainer, store=store, job="transfer", timeout_s=30) as sender:
            llm.init_weight_transfer_engine(
                {"init_info": {"store": store, "job": "transfer", "name": "engine", "options": {"verify": True}}}
            )
            seen = []
            for version in range(3):
                if version:
                    perturb(trainer, version)
                handle = sender.push(version)
                llm.start_weight_update()
                llm.update_weights({"update_info": {"min_version": version, "timeout_s": 30}})
                llm.finish_weight_update(weight_version=str(version))
                llm.reset_prefix_cache()
                assert handle.wait(30).delivered == ("engine-w0",)  # acknowledged: verified and staged
                expected, gap = hf_greedy(trainer, ids)
                assert gap > 1e-4
                out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                assert list(out[0].outputs[0].token_ids) == expected, f"version {version}"
                assert llm.get_weight_version() == str(version)
                seen.append(expected)
            assert seen[0] != seen[1] != seen[2]
            llm.shutdown_weight_transfer_engine()
    finally:
        llm.llm_engine.engine_core.shutdown()
