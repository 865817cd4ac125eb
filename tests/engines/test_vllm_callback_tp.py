"""A real Lightning trainer (2 CPU ranks, DDP, the callback's defaults: sharded push) feeds a real
TP=2 vLLM engine (in-process ``LLM``, multi-process executor, the wsync worker extension) with the
engine's defaults (``zero_copy``: both workers load each version out of both ranks' rings).

The trainer waits for the engine to hold each version (``max_version_lag=0``), so the engine
loads every one; at each, greedy tokens equal transformers' with the weights rank 0 pushed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import _vllm_only  # first: skips without vLLM
import pytest
import torch
from test_vllm_engine import NEW_TOKENS, PROMPTS, hf_greedy
from tiny_llama import write_tiny_llama

from lightning_wsync.engines.vllm import VllmWeightSync, make_llm
from lightning_wsync.testing.stores import host_store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), _vllm_only.PROCESSES]
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "_llm_ddp_trainer.py"
STEPS = 4


def test_a_ddp_trainers_callback_feeds_a_tp2_engine_loading_out_of_both_ranks_rings(
    tmp_path, port, monkeypatch, children
):
    import psutil
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core here, 2 worker processes
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    path = write_tiny_llama(tmp_path / "model", init_std=0.5)
    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    server = host_store("127.0.0.1", port, timeout_s=60)
    store = f"127.0.0.1:{port}"
    llm = make_llm(path, dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20,
                   tensor_parallel_size=2, distributed_executor_backend="mp", seed=0)  # fmt: skip
    for child in psutil.Process().children(recursive=True):  # the two workers, killed by PID at the end
        children.track(child.pid)
    out = tmp_path / "out"
    out.mkdir()
    trainer = None
    got: dict[int, list[list[int]]] = {}
    try:
        with VllmWeightSync(llm, store=store, job="cbtp", name="engine", timeout_s=120) as sync:  # the defaults
            env = {k: v for k, v in os.environ.items() if not k.startswith("WSYNC_")}
            env["OMP_NUM_THREADS"] = "1"
            cmd = [sys.executable, str(SCRIPT), str(path), str(out), "--store", store, "--job", "cbtp",
                   "--max-steps", str(STEPS)]  # fmt: skip
            trainer = subprocess.Popen(cmd, env=env, cwd=tmp_path, start_new_session=True, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
            children.track(trainer.pid)
            version = -1
            while version < STEPS:
                version = sync.wait_for_version(version + 1, timeout_s=300)
                assert [s["version"] for s in sync.state()] == [version, version]
                assert [s["zero_copy"] for s in sync.state()] == [True, True]  # out of the rings, no copy
                outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
                got[version] = [list(o.outputs[0].token_ids) for o in outs]
            output, _ = trainer.communicate(timeout=300)
            assert trainer.returncode == 0, output[-4000:]
    finally:
        if trainer is not None and trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
        llm.llm_engine.engine_core.shutdown()
        del server

    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["sharded_push"], r["unsharded_reason"]) for r in ranks] == [(True, None)] * 2  # the default path
    assert ranks[0]["versions"] == list(range(STEPS + 1)), ranks[0]
    assert sorted(got) == list(range(STEPS + 1)), sorted(got)  # max_version_lag=0: the engine loaded every one
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for version, tokens in sorted(got.items()):
        reference.load_state_dict(torch.load(out / f"v{version}.pt"))
        refs = [hf_greedy(reference, ids) for ids in prompt_ids]
        assert min(gap for _, gap in refs) > 1e-4, f"near-tie in the reference at version {version}"
        assert tokens == [r for r, _ in refs], f"version {version}"
    assert got[0] != got[STEPS], "training did not change the greedy tokens: the check would not see a stale load"
