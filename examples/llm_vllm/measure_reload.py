"""What one engine update costs: push -> VllmWeightSync.update() (copy, reload_weights, prefix-cache reset).

    python examples/llm_vllm/measure_reload.py demo     # the demo's 2-layer model (0.4M parameters)
    python examples/llm_vllm/measure_reload.py 124m     # 12 layers, hidden 768, vocab 16000 (~124M)

Runs the engine in-process with one sender in the same process (shared-memory path) and
prints the median of the timed updates as JSON.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from tiny_llama import write_tiny_llama
from transformers import AutoModelForCausalLM

from lightning_wsync import WeightSender
from lightning_wsync.engines.vllm import VllmWeightSync, make_llm

SIZES = {
    "demo": {},
    "124m": {"hidden_size": 768, "intermediate_size": 2560, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": 16000},
}  # fmt: skip


def main(size: str, pushes: int = 5) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_llama(Path(tmp) / "model", **SIZES[size])
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        params = sum(p.numel() for p in model.parameters())
        llm = make_llm(path, dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            store = f"127.0.0.1:{s.getsockname()[1]}"
        update_s: list[float] = []
        update_cpu_s: list[float] = []
        reload_s: list[float] = []
        with WeightSender(model, store=store, job="measure") as sender, VllmWeightSync(llm, store=store, job="measure") as sync:
            for version in range(pushes + 1):
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.0001)
                if version == 0:
                    sender.push(0)
                    sync.wait_for_version(0, timeout_s=60)
                    continue
                handle = sender.push(version)
                while sync.state()[0]["latest_published"] != version:  # announced; not yet applied
                    time.sleep(0.001)
                t0, c0 = time.perf_counter(), time.process_time()
                assert sync.update() == version
                update_s.append(time.perf_counter() - t0)
                update_cpu_s.append(time.process_time() - c0)  # load-independent: this process's CPU time
                handle.wait(60)
            # reload_weights alone, from tensors already in memory (no receiver copy, no cache reset).
            state = {k: v.clone() for k, v in model.state_dict().items()}
            for _ in range(pushes):
                t0 = time.perf_counter()
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
                reload_s.append(time.perf_counter() - t0)
        print(json.dumps({"size": size, "parameters": params, "mb_float32": round(params * 4 / 2**20, 1),
                          "update_s_median": round(statistics.median(update_s), 4),
                          "update_cpu_s_median": round(statistics.median(update_cpu_s), 4),
                          "reload_weights_s_median": round(statistics.median(reload_s), 4),
                          "update_s": [round(x, 4) for x in update_s]}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "demo")
