"""Rollout side of the LLM demo: a vLLM engine whose worker receives the trainer's weights.

Samples ``GROUP`` completions per prompt with the engine, scores them, sends them to the
trainer on the experience channel tagged with the version that generated them, and
applies the newest version between generate calls. Store and job come from
``WSYNC_STORE``/``WSYNC_JOB``. Exits once the trainer has closed.

    python examples/llm_vllm/rollout.py MODEL_DIR OUT_DIR [--tp 2] [--async]
"""

from __future__ import annotations

import argparse
import asyncio
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


class Recorder:
    """Scores a group of completions, logs it, and sends it to the trainer tagged with its version."""

    def __init__(self, out: Path, digits: set[int]) -> None:
        self.digits = digits
        self.writer = ExperienceWriter(capacity=4, timeout_s=120)
        self.log = (out / "rollout.jsonl").open("w")
        self.started = time.monotonic()
        self.batches = 0

    def send(self, completions: list[list[int]], version: int, engine_version: int | None, reload_s: float | None,
             paused_s: list[float] | None = None) -> bool | None:  # fmt: skip
        """Tagged ``version`` (the oldest that made a token); True: sent, False: trainer busy, None: gone.

        ``reload_s``: the update made before this batch; ``paused_s`` (async): the engine's pause
        of each update that landed since the previous batch."""
        rewards = torch.tensor([reward(c, self.digits) for c in completions])
        batch = {
            "prompt": torch.tensor([i for i, _ in enumerate(PROMPTS) for _ in range(GROUP)]),
            "completion": torch.tensor(completions),
            "reward": rewards,
        }
        self.log.write(json.dumps({"t": round(time.monotonic() - self.started, 3), "version": version,
                                   "engine_version": engine_version, "reward": round(float(rewards.mean()), 4),
                                   "reload_s": reload_s, "paused_s": paused_s}) + "\n")  # fmt: skip
        self.log.flush()
        self.batches += 1
        try:
            return self.writer.put(batch, version=version, block=False)
        except WeightSyncStoreError:  # the trainer is done and took its store along
            return None


def engine_kwargs(tp: int) -> dict[str, object]:
    kwargs: dict[str, object] = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                                 "kv_cache_memory_bytes": 64 << 20, "seed": 0, "tensor_parallel_size": tp}  # fmt: skip
    if tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    return kwargs


def main(model_dir: str, out_dir: str, tp: int) -> None:
    t_start = time.monotonic()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    llm = make_llm(model_dir, **engine_kwargs(tp))
    params = SamplingParams(n=GROUP, temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    rec = Recorder(Path(out_dir), digit_tokens(tok))
    with VllmWeightSync(llm, name="rollout", timeout_s=120) as sync:
        sync.wait_for_version(0, timeout_s=120)
        print(f"[rollout] engine (TP={tp}) up and at version {sync.version} {time.monotonic() - t_start:.1f} s after start", flush=True)
        while True:
            t0 = time.perf_counter()
            applied = sync.update()
            reload_s = time.perf_counter() - t0 if applied is not None else None
            if sync.sender_closed and applied is None:
                break
            version = sync.version
            assert version is not None
            outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
            sent = rec.send([list(c.token_ids) for o in outs for c in o.outputs], version, version, reload_s)
            if sent is None:
                break
            if not sent:
                try:  # the trainer is busy: wait for fresher weights instead of piling up stale batches
                    sync.wait_for_version(version + 1, timeout_s=1.0)
                except (WeightSyncTimeoutError, WeightSyncClosedError):
                    pass
        print(f"[rollout] done: {rec.batches} batches, final version {sync.version}", flush=True)
    rec.log.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of the engine")
    ap.add_argument("--async", dest="use_async", action="store_true",
                    help="AsyncLLM: requests stream continuously, updates land while they run")  # fmt: skip
    a = ap.parse_args()
    if a.use_async:
        from rollout_async import main_async

        asyncio.run(main_async(a.model_dir, a.out_dir, a.tp))
    else:
        main(a.model_dir, a.out_dir, a.tp)
