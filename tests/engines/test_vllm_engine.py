"""Weights into a running vLLM engine (real engine, in-process mode, tiny local Llama).

Runs where vLLM is installed (``bash .ci/run`` builds ``.venv-vllm`` for it); skipped
elsewhere. After every pushed version the engine's greedy tokens must equal those of
Hugging Face transformers holding the same weights, including for a prompt reused across
versions (served from the prefix cache unless it was reset).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip(
    "vllm", reason="vLLM not installed: pip install 'lightning-wsync[vllm]' (bash .ci/run tests it in .venv-vllm)"
)
pytest.importorskip("transformers", reason="transformers comes with vLLM")
sys.path.insert(0, str(ROOT / "examples" / "llm_vllm"))

from _vllm_only import PROCESSES  # noqa: E402  (after the skips)
from tiny_llama import write_tiny_llama  # noqa: E402  (after the skips and the examples' path)

from lightning_wsync import WeightSender, WeightSyncError  # noqa: E402
from lightning_wsync.engines.vllm import VllmWeightSync, make_llm  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NEW_TOKENS = 16
# The long prompt spans several KV-cache blocks, so its prefix is cached across versions.
PROMPTS = ["say digits: 123", "please count number " * 40 + ":", "abc 42 . say"]


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int]) -> tuple[list[int], float]:
    """Greedy tokens (EOS not special, as with ignore_eos) and the smallest top-1/top-2 logit gap."""
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    gap = float("inf")
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(ids).logits[0, -1]
            top = torch.topk(logits, 2).values
            gap = min(gap, float(top[0] - top[1]))
            nxt = int(logits.argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out, gap


def perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def test_engine_follows_pushed_versions_and_rejects_a_corrupted_one(tmp_path, port, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: starts in seconds
    path = write_tiny_llama(tmp_path / "model", init_std=0.5)  # wide logits: greedy ties are unlikely
    trainer_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = make_llm(path, dtype="float32", enforce_eager=True, max_model_len=256,
                   kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True, block_size=32, seed=0)  # fmt: skip
    assert len(prompt_ids[1]) > 2 * llm.llm_engine.vllm_config.cache_config.block_size

    def engine_tokens() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def reference() -> list[list[int]]:
        refs = [hf_greedy(trainer_model, ids) for ids in prompt_ids]
        assert min(gap for _, gap in refs) > 1e-4, "near-tie in the reference; pick another seed"
        return [r for r, _ in refs]

    store = f"127.0.0.1:{port}"
    seen: list[list[list[int]]] = []
    with (
        WeightSender(trainer_model, store=store, job="vllm", timeout_s=30) as sender,
        VllmWeightSync(llm, store=store, job="vllm", name="engine", verify=True, timeout_s=30) as sync,
    ):
            assert sync.names == ["engine-w0"]
            for version in range(3):
                if version:
                    perturb(trainer_model, version)
                handle = sender.push(version)
                assert sync.wait_for_version(version, timeout_s=30) == version
                assert handle.wait(30).delivered == ("engine-w0",)
                assert sync.version == version and sync.state()[0]["version"] == version
                expected = reference()
                assert engine_tokens() == expected, f"version {version}"
                seen.append(expected)
            assert seen[0] != seen[1] != seen[2]  # every version really changed the output

            # A bit flips in the snapshot after its checksums were published: rejected, and the
            # engine keeps generating with version 2.
            held = seen[-1]
            perturb(trainer_model, 3)
            handle = sender.push(3)
            deadline = time.monotonic() + 30
            while not sender.store.check(["wsync/vllm/v/3/sums"]):  # bounded poll: sums published
                assert time.monotonic() < deadline
                time.sleep(0.005)
            newest = sender._ring.newest()
            assert newest is not None and newest.version == 3
            sender._ring.buffers[newest.slot][100] ^= 0x10  # a bit flips in shared memory after the snapshot
            while sync.state()[0]["rejected"] == 0:
                assert time.monotonic() < deadline, "the corrupted version was never checked"
                assert sync.update() is None
                time.sleep(0.005)
            assert sync.update() is None and sync.version == 2
            assert engine_tokens() == held
            assert handle.wait(30).failed["engine-w0"].startswith("rejected version 3: checksum mismatch")

            perturb(trainer_model, 4)
            sender.push(4)
            assert sync.wait_for_version(4, timeout_s=30) == 4
            assert engine_tokens() == reference() != held
    with pytest.raises(WeightSyncError, match="no receiver runs here"):
        sync.update()


@PROCESSES
def test_multiprocess_engine_receives_inside_its_worker_process(tmp_path, port, monkeypatch, children):
    """vLLM's default mode: the worker (and its receiver) lives in the engine-core process."""
    import os

    import psutil
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from lightning_wsync import WeightSyncTimeoutError

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    path = write_tiny_llama(tmp_path / "model", init_std=0.5)
    trainer_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPTS[0]).input_ids
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = make_llm(path, dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20)
    for child in psutil.Process().children(recursive=True):  # vLLM's engine-core process, killed by PID at the end
        children.track(child.pid)
    store = f"127.0.0.1:{port}"
    try:
        with (
            WeightSender(trainer_model, store=store, job="vllm-mp", timeout_s=30) as sender,
            VllmWeightSync(llm, store=store, job="vllm-mp", timeout_s=30) as sync,
        ):
            (name,) = sync.names
            assert name.endswith("-w0") and name != f"vllm-{os.getpid()}-w0"  # named by the worker's pid
            # The worker's WeightSyncTimeoutError comes back as that class, not vLLM's wrapper.
            with pytest.raises(WeightSyncTimeoutError, match=r"no version >= 0 within timeout_s=0.5"):
                sync.wait_for_version(0, timeout_s=0.5)
            for version in (0, 1):
                if version:
                    perturb(trainer_model, version)
                sender.push(version)
                assert sync.wait_for_version(version, timeout_s=30) == version
                expected, gap = hf_greedy(trainer_model, ids)
                assert gap > 1e-4
                out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                assert list(out[0].outputs[0].token_ids) == expected, f"version {version}"
    finally:
        llm.llm_engine.engine_core.shutdown()
