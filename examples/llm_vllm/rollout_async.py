"""The demo's rollout side on ``AsyncLLM`` (``rollout.py --async``): requests never stop.

Every prompt's group is its own request; a background task applies each new version as
soon as every worker has staged it, pausing the engine at a step boundary (requests in
flight keep their place and KV). A batch is tagged with the oldest version any of its
tokens came from, so the trainer's staleness bound stays honest.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from rollout import Recorder, engine_kwargs
from task import GROUP, NEW_TOKENS, PROMPTS, digit_tokens
from transformers import AutoTokenizer
from vllm import AsyncEngineArgs, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM

from lightning_wsync.engines.vllm import WORKER_EXTENSION
from lightning_wsync.engines.vllm_async import AsyncVllmWeightSync, VersionedOutput


async def follow(sync: AsyncVllmWeightSync, done: asyncio.Event) -> None:
    while not done.is_set():
        await sync.update()
        try:
            await asyncio.wait_for(done.wait(), 0.05)  # poll period for new versions
        except asyncio.TimeoutError:
            pass


async def main_async(model_dir: str, out_dir: str, tp: int) -> None:
    t_start = time.monotonic()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    args = AsyncEngineArgs(model_dir, worker_extension_cls=WORKER_EXTENSION, **engine_kwargs(tp))  # type: ignore[arg-type]
    engine = AsyncLLM.from_engine_args(args)
    params = SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True)  # n=1: exact stamps
    rec = Recorder(Path(out_dir), digit_tokens(tok))
    sync = await AsyncVllmWeightSync.start(engine, name="rollout", timeout_s=120)
    done = asyncio.Event()
    try:
        await sync.wait_for_version(0, timeout_s=120)
        print(f"[rollout] async engine (TP={tp}) at version {sync.version} {time.monotonic() - t_start:.1f} s after start", flush=True)
        follower = asyncio.create_task(follow(sync, done))

        async def one(ids: list[int]) -> VersionedOutput:
            last = None
            async for out in sync.generate({"prompt_token_ids": ids}, params, uuid.uuid4().hex):
                last = out
            assert last is not None
            return last

        reported = len(sync.paused_s)
        while not await sync.sender_closed():
            outs = await asyncio.gather(*(one(ids) for ids in prompt_ids for _ in range(GROUP)))
            stamped = [v for o in outs for v in (o.version, *(v for _, v in o.switches))]
            oldest = min(v for v in stamped if v is not None)
            paused, reported = sync.paused_s[reported:], len(sync.paused_s)
            tokens = [list(o.output.outputs[0].token_ids) for o in outs]
            if rec.send(tokens, oldest, sync.version, None, paused) is None:
                break
        done.set()
        await follower
        print(f"[rollout] done: {rec.batches} batches, final version {sync.version}, "
              f"{len(sync.paused_s)} updates paused the engine {sum(sync.paused_s) * 1e3:.0f} ms in all", flush=True)  # fmt: skip
    finally:
        done.set()
        await sync.close()
        engine.shutdown()
        rec.log.close()
