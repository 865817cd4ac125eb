"""A tensor-parallel vLLM engine (TP=2, CPU, multi-process executor) follows pushed versions.

Every worker holds half of each sharded weight, so a worker left on another version
garbles every token; greedy tokens equal to transformers' at the reported version show
both workers loaded that same version. Versions are also pushed faster than the engine
reloads (landing between the workers' stages). With ``zero_copy`` (the default) both workers
load straight out of the host's shared memory; ``zero_copy=False`` keeps the copying path tested.
"""

from __future__ import annotations

import threading

import _vllm_only  # first: skips without vLLM
import pytest
import torch
from test_vllm_engine import NEW_TOKENS, PROMPTS, hf_greedy, perturb
from tiny_llama import write_tiny_llama

from lightning_wsync import SenderConfig, WeightSender
from lightning_wsync._planes.shares import ShareWriter
from lightning_wsync._push.shares import prepare_shares
from lightning_wsync.engines.vllm import VllmWeightSync, make_llm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), _vllm_only.PROCESSES]

BURST = range(3, 9)  # versions pushed every few ms while the engine updates


# zero_copy=None: the default (not passed), which lends here (the trainer's host); False keeps the copying path tested.
@pytest.mark.parametrize(("zero_copy", "sharded"), [(False, False), (None, False), (None, True)],
                         ids=["copying", "zero_copy", "zero_copy-sharded"])  # fmt: skip
def test_tp2_engine_loads_one_version_in_both_workers(tmp_path, port, monkeypatch, children, zero_copy, sharded):
    """``sharded``: the versions come as two trainer ranks' shares (rank 0's sender, rank 1's ring in this process,
    as the callback's default pushes under DDP x 2); with ``zero_copy`` both workers load out of both rings."""
    import dataclasses

    import psutil
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core here, 2 worker processes
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    path = write_tiny_llama(tmp_path / "model", init_std=0.5)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = make_llm(path, dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20,
                   tensor_parallel_size=2, distributed_executor_backend="mp", seed=0)  # fmt: skip
    for child in psutil.Process().children(recursive=True):  # the two workers, killed by PID at the end
        children.track(child.pid)
    pushed: dict[int, dict[str, torch.Tensor]] = {}

    def push(version: int) -> None:
        if version:
            perturb(trainer, version)
        pushed[version] = {k: v.clone() for k, v in trainer.state_dict().items()}
        if writer is not None:
            writer.write(version)  # rank 1's share first, as the callback's ranks do side by side
        sender.push(version)

    def check(version: int) -> list[list[int]]:
        reference.load_state_dict(pushed[version])
        refs = [hf_greedy(reference, ids) for ids in prompt_ids]
        assert min(gap for _, gap in refs) > 1e-4, "near-tie in the reference; pick another seed"
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        assert got == [r for r, _ in refs], f"version {version}"
        return got

    store = f"127.0.0.1:{port}"
    cfg = SenderConfig(job="tp2", timeout_s=60)
    writer, shares = None, None
    if sharded:
        mine, theirs = prepare_shares(trainer, cfg, 0, 2), prepare_shares(trainer, cfg, 1, 2)
        writer = ShareWriter(theirs, cfg)
        shares = dataclasses.replace(mine, plan=mine.plan.with_segments(["", writer.name]))
    try:
        with (
            WeightSender(trainer, store=store, config=cfg, shares=shares) as sender,
            VllmWeightSync(llm, store=store, job="tp2", name="engine", timeout_s=60,
                           **({} if zero_copy is None else {"zero_copy": zero_copy})) as sync,  # fmt: skip
        ):
            assert sync.names == ["engine-w0", "engine-w1"]
            lends = zero_copy is None
            assert [s["zero_copy"] for s in sync.state()] == [lends, lends]
            seen = []
            for version in range(3):
                push(version)
                assert sync.wait_for_version(version) == version
                assert [s["version"] for s in sync.state()] == [version, version]
                seen.append(check(version))
            assert seen[0] != seen[1] != seen[2]

            done = threading.Event()

            def burst() -> None:
                for version in BURST:
                    push(version)
                    if done.wait(0.02):
                        return

            pusher = threading.Thread(target=burst, name="wsync-test-burst", daemon=True)
            pusher.start()
            applied = []
            try:
                while sync.version != BURST[-1]:
                    version = sync.wait_for_version(sync.version + 1, timeout_s=60)
                    assert [s["version"] for s in sync.state()] == [version, version]
                    check(version)
                    applied.append(version)
            finally:
                done.set()
                pusher.join(30)
            assert applied == sorted(set(applied)) and applied[-1] == BURST[-1]
    finally:
        llm.llm_engine.engine_core.shutdown()
        if writer is not None:
            writer.close()
