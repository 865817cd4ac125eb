"""Adapter-only pushes against full pushes into a real vLLM server (CPU): bytes and update time.

    PYTHONPATH=. .venv-vllm/bin/python tests/engines/bench_lora_server.py [--hidden 1024 --layers 8 --pushes 6]

For each mode, one ``python -m vllm.entrypoints.openai.api_server`` with the ``wsync`` backend
(a random Llama of ``tiny_llama`` sizes) and a :class:`WeightSender` in this process (same host:
shared memory). ``full`` pushes every weight and the server reloads them; ``lora`` wraps the
model with PEFT, pushes only the adapter (``include=ADAPTER_TENSORS``), the server's workers
keep it and ``/v1/load_lora_adapter`` builds it as ``wsync-v{N}``. Reported per push: bytes
the sender publishes, ``push()`` (the snapshot), push -> every server holds the version
(staged, paused, loaded, labelled; with ``lora`` also served by name), and push -> the first
greedy token of a completion on that version (p50 / max).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "examples" / "llm_vllm")]


def run(mode: str, args: argparse.Namespace) -> dict[str, float | int | str]:
    import torch
    from _vllm_server import Server
    from bench_lora import step_and_push
    from conftest import free_port
    from tiny_llama import write_tiny_llama
    from transformers import AutoModelForCausalLM

    from lightning_wsync import WeightSender
    from lightning_wsync.engines.lora import ADAPTER_TENSORS, adapter_config, adapter_name
    from lightning_wsync.engines.vllm_lora_servers import ServedAdapterNames
    from lightning_wsync.engines.vllm_servers import VllmServers, apply_version

    tmp = Path(tempfile.mkdtemp())
    path = write_tiny_llama(tmp / "model", hidden_size=args.hidden, num_hidden_layers=args.layers,
                            intermediate_size=3 * args.hidden)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    server_args: list[str] = []
    env: dict[str, str] = {}
    send: dict[str, object] = {}
    options: dict[str, object] = {"timeout_s": 120}
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets))
        server_args = ["--enable-lora", "--max-lora-rank", str(args.rank), "--max-loras", "2", "--max-cpu-loras", "2"]
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
        send = {"include": ADAPTER_TENSORS}
        options.update(lora=adapter_config(model), keep_adapters=2)
    server = Server(path, free_port(), tmp / "server.log", extra_env=env, args=server_args)
    try:
        server.wait_ready(900)
        servers = VllmServers([server.url], timeout_s=300)
        names = ServedAdapterNames(servers, 2) if mode == "lora" else None
        updates, firsts, snapshots = [], [], []
        with WeightSender(model, store=f"127.0.0.1:{free_port()}", job="bench", timeout_s=120, **send) as sender:
            servers.init_weight_transfer_engine({"store": sender.store_address, "job": "bench", "options": options})
            for version in range(args.pushes + 1):
                started, pushed = step_and_push(model, sender, version)
                if names is not None:
                    names.apply(servers, version, timeout_s=120)
                else:
                    apply_version(servers, servers, version, timeout_s=120)
                applied = time.perf_counter()
                server.complete([1, 2, 3, 4], 1, model=adapter_name(version) if names else None)
                if version:  # the first one also starts the planes
                    snapshots.append(pushed - started)
                    updates.append(applied - started)
                    firsts.append(time.perf_counter() - started)
            total = sum(p.numel() * p.element_size() for p in model.parameters())
            return {"mode": mode, "bytes": sender.layout.total_bytes, "model_bytes": total,
                    "snapshot_p50_s": statistics.median(snapshots), "update_p50_s": statistics.median(updates),
                    "update_max_s": max(updates), "first_p50_s": statistics.median(firsts)}  # fmt: skip
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--pushes", type=int, default=6)
    args = parser.parse_args()
    rows = [run(mode, args) for mode in ("full", "lora")]
    print(f"model: hidden {args.hidden}, {args.layers} layers, fp32 ({rows[0]['model_bytes'] / 1e6:.0f} MB); LoRA "
          f"rank {args.rank} on all linear layers; {args.pushes} pushes; vLLM {__import__('vllm').__version__} CPU "
          f"server, sender on the same host (shared memory); load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'push':6} {'MB per push':>12} {'push()':>9} {'push -> held':>13} {'max':>7} {'push -> 1st token':>18}")
    for r in rows:
        print(f"{r['mode']:6} {float(r['bytes']) / 1e6:12.2f} {float(r['snapshot_p50_s']) * 1e3:6.1f} ms "
              f"{float(r['update_p50_s']) * 1e3:10.0f} ms {float(r['update_max_s']) * 1e3:4.0f} ms "
              f"{float(r['first_p50_s']) * 1e3:15.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
