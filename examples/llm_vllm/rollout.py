"""Rollout side of the LLM demo: a vLLM engine whose worker receives the trainer's weights.

Samples ``GROUP`` completions per prompt with the engine, scores them, sends them to the
trainer on the experience channel tagged with the version that generated them, and
applies the newest version between generate calls. Store and job come from
``WSYNC_STORE``/``WSYNC_JOB``. Exits once the trainer has closed.

    python examples/llm_vllm/rollout.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: starts in seconds
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from task import GROUP, NEW_TOKENS, PROMPTS, digit_tokens, reward
from transformers import AutoTokenizer
from vllm import SamplingParams

from lightning_wsync import (
    ExperienceWriter,
    WeightSyncClosedError,
    WeightSyncStoreError,
    WeightSyncTimeoutError,
)
from lightning_wsync.engines.vllm import VllmWeightSync, make_llm


def main(model_dir: str, out_dir: str) -> None:
    out = Path(out_dir)
    t_start = time.monotonic()
    tok = AutoTokenizer.from_pretrained(model_dir)
    digits = digit_tokens(tok)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    llm = make_llm(model_dir, dtype="float32", enforce_eager=True, max_model_len=256,
                   kv_cache_memory_bytes=64 << 20, seed=0)  # fmt: skip
    params = SamplingParams(n=GROUP, temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    writer = ExperienceWriter(capacity=4, timeout_s=120)
    log = (out / "rollout.jsonl").open("w")
    started = time.monotonic()
    batches = 0
    with VllmWeightSync(llm, name="rollout", timeout_s=120) as sync:
        sync.wait_for_version(0, timeout_s=120)
        print(f"[rollout] engine up and at version {sync.version} {time.monotonic() - t_start:.1f} s after start", flush=True)
        while True:
            t0 = time.perf_counter()
            applied = sync.update()
            reload_s = time.perf_counter() - t0 if applied is not None else None
            if sync.sender_closed and applied is None:
                break
            version = sync.version
            assert version is not None
            outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
            completions = [list(c.token_ids) for o in outs for c in o.outputs]
            rewards = torch.tensor([reward(c, digits) for c in completions])
            batch = {
                "prompt": torch.tensor([i for i, _ in enumerate(PROMPTS) for _ in range(GROUP)]),
                "completion": torch.tensor(completions),
                "reward": rewards,
            }
            log.write(json.dumps({"t": round(time.monotonic() - started, 3), "version": version,
                                  "reward": round(float(rewards.mean()), 4), "reload_s": reload_s}) + "\n")  # fmt: skip
            log.flush()
            batches += 1
            try:
                sent = writer.put(batch, version=version, block=False)
            except WeightSyncStoreError:  # the trainer is done and took its store along
                break
            if not sent:
                try:  # the trainer is busy: wait for fresher weights instead of piling up stale batches
                    sync.wait_for_version(version + 1, timeout_s=1.0)
                except (WeightSyncTimeoutError, WeightSyncClosedError):
                    pass
        print(f"[rollout] done: {batches} batches, final version {sync.version}", flush=True)
    log.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
