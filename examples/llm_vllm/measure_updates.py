"""Figures for weight updates under continuous generation (AsyncLLM, TP=1 or 2, CPU).

Clients keep requests streaming through ``AsyncVllmWeightSync.generate``; a trainer in
this process pushes a new version every ``--interval-s``. Measured:

- push -> first token generated with the new version (p50, p95), from the version stamps;
- the engine's paused time per update (``pause_generation`` to ``resume_generation``);
- tokens/s lost: generated tokens/s over a phase without updates minus with updates.

    python examples/llm_vllm/measure_updates.py --tp 2 --size demo --updates 20

Prints one JSON line; ``--size 124m`` builds a ~124M-parameter Llama (12 layers, 768 wide).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from tiny_llama import write_tiny_llama

from lightning_wsync import WeightSender
from lightning_wsync.engines.vllm import WORKER_EXTENSION
from lightning_wsync.engines.vllm_async import AsyncVllmWeightSync

SIZES = {
    "demo": {},
    "124m": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": 8192},
}  # fmt: skip
CLIENTS = 4
TOKENS = 64


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


async def measure(engine: object, trainer: torch.nn.Module, store: str, args: argparse.Namespace) -> dict[str, object]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 37))}
    first_token_at: dict[int, float] = {}
    tokens = [0]
    streaming = [True]
    with WeightSender(trainer, store=store, job="measure", timeout_s=120) as sender:
        sync = await AsyncVllmWeightSync.start(engine, store=store, job="measure", timeout_s=120)
        sender.push(0)
        await sync.wait_for_version(0)

        async def client(c: int) -> None:
            n = 0
            while streaming[0]:
                seen = 0
                async for out in sync.generate(prompt, params, f"c{c}-{n}"):
                    ids = out.output.outputs[0].token_ids
                    tokens[0] += len(ids) - seen
                    for i in range(seen, len(ids)):
                        v = out.version_of(i)
                        if v is not None and v not in first_token_at:
                            first_token_at[v] = time.perf_counter()
                    seen = len(ids)
                n += 1

        tasks = [asyncio.create_task(client(c)) for c in range(CLIENTS)]
        await asyncio.sleep(args.warmup_s)  # pacing of the measurement, not synchronisation
        start, t0 = tokens[0], time.perf_counter()
        await asyncio.sleep(args.phase_s)
        base_rate = (tokens[0] - start) / (time.perf_counter() - t0)
        pushed_at: dict[int, float] = {}
        start, t0 = tokens[0], time.perf_counter()
        for v in range(1, args.updates + 1):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.mul_(1.0001)
            pushed_at[v] = time.perf_counter()
            sender.push(v)
            await sync.wait_for_version(v)
            await asyncio.sleep(args.interval_s)
        update_rate = (tokens[0] - start) / (time.perf_counter() - t0)
        streaming[0] = False
        await asyncio.gather(*tasks)
        await sync.close()
    latency = [first_token_at[v] - pushed_at[v] for v in pushed_at if v in first_token_at]
    paused = sync.paused_s[1:]
    return {
        "tp": args.tp, "size": args.size, "params_m": round(sum(p.numel() for p in trainer.parameters()) / 1e6, 1),
        "updates": args.updates, "interval_s": args.interval_s,
        "push_to_first_token_s": {"p50": pct(latency, 0.5), "p95": pct(latency, 0.95), "n": len(latency)},
        "paused_s": {"p50": pct(paused, 0.5), "p95": pct(paused, 0.95)},
        "tokens_per_s": {"without_updates": round(base_rate, 1), "with_updates": round(update_rate, 1)},
        "tokens_per_s_lost": round(base_rate - update_rate, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2))
    parser.add_argument("--size", default="demo", choices=sorted(SIZES))
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--interval-s", type=float, default=0.5, help="between one update's end and the next push")
    parser.add_argument("--phase-s", type=float, default=5.0, help="length of the no-update baseline")
    parser.add_argument("--warmup-s", type=float, default=2.0)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    if args.tp == 2:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    with socket.socket() as s:  # a free port for the trainer's store
        s.bind(("127.0.0.1", 0))
        store = f"127.0.0.1:{s.getsockname()[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_llama(Path(tmp) / "model", **SIZES[args.size])
        trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            str(path), dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=256 << 20,
            tensor_parallel_size=args.tp, distributed_executor_backend="mp" if args.tp > 1 else None,
            worker_extension_cls=WORKER_EXTENSION))  # fmt: skip
        try:
            print(json.dumps(asyncio.run(measure(engine, trainer, store, args))), flush=True)
        finally:
            engine.shutdown()


if __name__ == "__main__":
    main()
