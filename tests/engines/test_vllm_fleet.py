"""One version across a fleet with a real engine (issue 24): a vLLM engine (``VllmWeightSync``,
TP=1, in-process) and a plain receiver in another process, both with ``fleet="mix"``, while
the trainer pushes every few milliseconds; whenever the fleet's switch is the same before
and after both are asked, both hold exactly that version."""

from __future__ import annotations

import threading
import time

import _vllm_only  # noqa: F401  (first: skips without vLLM)
import pytest
import torch
from _fleet_workers import fleet_member_main
from tiny_llama import write_tiny_llama

from lightning_wsync import WeightSender
from lightning_wsync.engines.vllm import VllmWeightSync, make_llm
from lightning_wsync.testing.procs import Children, receive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_an_engine_and_a_plain_receiver_switch_to_the_same_versions(tmp_path, port, server, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path = write_tiny_llama(tmp_path / "model")
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = make_llm(path, dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20)
    store, job = f"127.0.0.1:{port}", "fleet-engine"
    stop = threading.Event()
    stalls: list[float] = []

    def push_every_few_ms(sender: WeightSender) -> None:
        version = 0
        while not stop.is_set():
            version += 1
            with torch.no_grad():
                for p in trainer.parameters():
                    p.mul_(0.999)
            started = time.perf_counter()
            sender.push(version)
            stalls.append(time.perf_counter() - started)
            stop.wait(0.005)

    try:
        with WeightSender(trainer, store=store, job=job, timeout_s=20) as sender, Children(join_timeout_s=5) as kids:
            conn = kids.start(
                fleet_member_main, (store, job, "plain", {"fleet": "mix", "timeout_s": 30}, "target"), "plain"
            )
            receive(conn, 60, "the plain receiver ready")
            with VllmWeightSync(llm, store=store, job=job, name="engine", fleet="mix", timeout_s=30) as sync:
                pusher = threading.Thread(target=push_every_few_ms, args=(sender,), daemon=True)
                pusher.start()
                try:
                    seen, raced = [], 0
                    deadline = time.monotonic() + 120
                    while (len(seen) < 20 or len({v for v, _, _ in seen}) < 5) and time.monotonic() < deadline:
                        before = (sender.fleet_switches("mix") or [None])[-1]
                        sync.update()
                        conn.send("update")
                        plain = receive(conn, 30, "plain update")[1]
                        after = (sender.fleet_switches("mix") or [None])[-1]
                        if before is None or before != after or len(before.rids) != 2:
                            raced += 1
                            continue
                        seen.append((before.version, sync.version, plain))
                finally:
                    stop.set()
                    pusher.join(timeout=10)
                state = sync.state()
                conn.send("stop")
        switch = state[0]["fleet_switch"]
        assert switch["version"] >= seen[-1][0] and len(switch["rids"]) == 2 and switch["at"] > 0, switch
        assert len(seen) >= 20, f"only {len(seen)} observations ({raced} raced a switch)"
        assert all(v == engine == plain for v, engine, plain in seen), f"engine and receiver differ: {seen}"
        assert len({v for v, _, _ in seen}) >= 5, f"the fleet hardly moved: {seen}"
        assert max(stalls) < 0.5, f"push() stalled {max(stalls):.3f} s"
    finally:
        llm.llm_engine.engine_core.shutdown()
