"""Per-worker memory of a tensor-parallel engine, with and without ``zero_copy``.

    python examples/llm_vllm/measure_memory.py demo 2              # the default, zero_copy="auto" (lends here)
    python examples/llm_vllm/measure_memory.py demo 2 --copy       # zero_copy=False: a private copy each
    python examples/llm_vllm/measure_memory.py 124m 2 [--copy]

Starts a TP engine (CPU, multi-process executor, engine core in this process) and a sender
in this process, applies a few versions, then prints each worker process's resident
anonymous memory (``RssAnon``: its private pages; shared memory is not counted) as JSON.
The difference between the two runs is what ``zero_copy`` saves per worker (``auto`` lends
here: the engine runs on the sender's host).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
import torch
from measure_reload import SIZES
from tiny_llama import write_tiny_llama
from transformers import AutoModelForCausalLM

from lightning_wsync import WeightSender
from lightning_wsync.engines.vllm import VllmWeightSync, make_llm


def rss_anon_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no RssAnon for pid {pid}")


def main(size: str, tp: int, zero_copy: bool | str, versions: int = 3) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_llama(Path(tmp) / "model", **SIZES[size])
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        params = sum(p.numel() for p in model.parameters())
        llm = make_llm(path, dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20,
                       tensor_parallel_size=tp, distributed_executor_backend="mp")  # fmt: skip
        workers = [p.pid for p in psutil.Process().children(recursive=True) if "worker" in p.name().lower()]
        assert len(workers) == tp, [p.name() for p in psutil.Process().children(recursive=True)]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            store = f"127.0.0.1:{s.getsockname()[1]}"
        try:
            before = {pid: rss_anon_mib(pid) for pid in workers}
            with (
                WeightSender(model, store=store, job="memory") as sender,
                VllmWeightSync(llm, store=store, job="memory", zero_copy=zero_copy) as sync,
            ):
                for version in range(versions):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.mul_(1.0001)
                    sender.push(version)
                    assert sync.wait_for_version(version, timeout_s=120) == version
                after = {pid: rss_anon_mib(pid) for pid in workers}
                lent = [s["zero_copy"] for s in sync.state()]
        finally:
            llm.llm_engine.engine_core.shutdown()
    print(json.dumps({
        "size": size, "tp": tp, "zero_copy": zero_copy, "workers_load_out_of_shared_memory": lent,
        "parameters": params, "mib_float32": round(params * 4 / 2**20, 1),
        "worker_rss_anon_mib_before": [round(before[p], 1) for p in workers],
        "worker_rss_anon_mib_after": [round(after[p], 1) for p in workers],
        "worker_growth_mib": [round(after[p] - before[p], 1) for p in workers],
    }))  # fmt: skip


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args[0] if args else "demo", int(args[1]) if len(args) > 1 else 2, False if "--copy" in sys.argv else "auto")
