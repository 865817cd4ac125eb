"""Adapter-only pushes against full pushes into a real vLLM engine (CPU): bytes and update time.

    .venv-vllm/bin/python tests/engines/bench_lora.py [--hidden 1024 --layers 8 --rank 16 --pushes 8]

For each mode, in its own process: a random Llama (``tiny_llama`` sizes), an in-process
``vllm.LLM`` and a :class:`WeightSender` on one host (shared memory). ``full`` pushes every
weight and the engine reloads them (``reload_weights``); ``lora`` wraps the model with PEFT,
pushes only the adapter (``include=ADAPTER_TENSORS``) and the engine adds it as an in-memory
adapter. Reported per push: bytes the sender publishes (what every receiver reads, on any
plane), and push -> engine serving that version (snapshot, transfer, verify, load), p50/max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "llm_vllm"))


def run(mode: str, args: argparse.Namespace) -> dict[str, object]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from tiny_llama import write_tiny_llama
    from transformers import AutoModelForCausalLM

    from lightning_wsync import WeightSender
    from lightning_wsync.engines.lora import ADAPTER_TENSORS
    from lightning_wsync.engines.vllm import VllmWeightSync, make_llm

    path = write_tiny_llama(Path(tempfile.mkdtemp()) / "model", hidden_size=args.hidden, num_hidden_layers=args.layers,
                            intermediate_size=3 * args.hidden)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine_kwargs: dict[str, object] = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                                        "kv_cache_memory_bytes": 64 << 20}  # fmt: skip
    sync_kwargs: dict[str, object] = {}
    send_kwargs: dict[str, object] = {}
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets))
        engine_kwargs.update(enable_lora=True, max_lora_rank=args.rank, max_loras=2)
        sync_kwargs.update(lora=model)
        send_kwargs.update(include=ADAPTER_TENSORS)
    llm = make_llm(path, **engine_kwargs)
    times: list[float] = []
    snapshots: list[float] = []  # push() alone: the snapshot the training step waits for
    with (
        WeightSender(model, store="127.0.0.1:0", job="bench", timeout_s=120, **send_kwargs) as sender,
        VllmWeightSync(llm, store=sender.store_address, job="bench", timeout_s=120, **sync_kwargs) as sync,
    ):
        for version in range(args.pushes + 1):
            started, pushed = step_and_push(model, sender, version)
            sync.wait_for_version(version, timeout_s=120)
            if version:  # the first one also starts the planes
                times.append(time.perf_counter() - started)
                snapshots.append(pushed - started)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        return {"mode": mode, "bytes": sender.layout.total_bytes, "model_bytes": total,
                "p50_s": statistics.median(times), "max_s": max(times),
                "snapshot_p50_s": statistics.median(snapshots)}  # fmt: skip


def step_and_push(model: Any, sender: Any, version: int) -> tuple[float, float]:
    """Move every trainable weight a little and push ``version``; ``push()``'s start and end
    (``time.perf_counter`` seconds)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01)
    started = time.perf_counter()
    sender.push(version)
    return started, time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--pushes", type=int, default=8)
    parser.add_argument("--mode", choices=["full", "lora"])
    args = parser.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(run(args.mode, args)), flush=True)
        return
    rows = []
    for mode in ("full", "lora"):
        cmd = [sys.executable, __file__, "--mode", mode, *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout
        rows.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    vllm_version = __import__("vllm").__version__
    print(f"model: hidden {args.hidden}, {args.layers} layers, fp32; LoRA rank {args.rank} on all linear layers; "
          f"{args.pushes} pushes, vLLM {vllm_version} CPU, in-process LLM, shared memory")  # fmt: skip
    print(f"{'push':6} {'MB per push':>12} {'push() p50':>11} {'push -> served p50':>19} {'max':>8}")
    for r in rows:
        print(f"{r['mode']:6} {r['bytes'] / 1e6:12.2f} {r['snapshot_p50_s'] * 1e3:8.1f} ms "
              f"{r['p50_s'] * 1e3:16.1f} ms {r['max_s'] * 1e3:5.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
