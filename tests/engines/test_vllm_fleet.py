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


def test_a_stopped_plain_receiver_is_left_out_and_the_engine_moves_on(tmp_path, port, server, monkeypatch):
    """The plain receiver SIGSTOPped past the sender's ``timeout_s``: it is named in a switch,
    the engine keeps switching (greedy tokens equal transformers' at each version it
    reports), ``push()`` never waits; after SIGCONT both hold the same version again."""
    import os
    import signal

    from _fleet_workers import _Digests
    from test_vllm_engine import NEW_TOKENS, PROMPTS, hf_greedy
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path = write_tiny_llama(tmp_path / "model", init_std=0.5)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    base = {k: v.clone() for k, v in trainer.state_dict().items()}
    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = make_llm(path, dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=0)
    store, job, timeout_s = f"127.0.0.1:{port}", "fleet-engine-stall", 2.0
    digests: dict[int, str] = {}
    stalls: list[float] = []
    stop = threading.Event()

    def weights_at(version: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(version)
        return {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()}

    def push_every_few_ms(sender: WeightSender) -> None:
        version = 0
        while not stop.is_set():
            version += 1
            weights = weights_at(version)
            trainer.load_state_dict(weights)
            digest = _Digests()
            digest(weights, version)
            digests[version] = digest.digest
            started = time.perf_counter()
            sender.push(version)
            stalls.append(time.perf_counter() - started)
            stop.wait(0.01)

    def engine_matches(version: int) -> bool | None:
        """The engine's greedy tokens equal transformers' at ``version`` (None: a near-tie there)."""
        reference.load_state_dict(weights_at(version))
        refs = [hf_greedy(reference, ids) for ids in prompt_ids]
        if min(gap for _, gap in refs) <= 1e-4:
            return None
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs] == [r for r, _ in refs]

    try:
        with WeightSender(trainer, store=store, job=job, timeout_s=timeout_s) as sender, Children(5) as kids:
            conn = kids.start(
                fleet_member_main, (store, job, "plain", {"fleet": "mix", "timeout_s": 30}, "target"), "plain"
            )
            plain_rid = receive(conn, 60, "the plain receiver ready")[1]
            plain_pid = kids.pids[0]
            switches = lambda: sender.fleet_switches("mix")  # noqa: E731
            both_in = lambda: any(plain_rid in s.rids and len(s.rids) == 2 for s in switches())  # noqa: E731

            def left_out_of_one() -> bool:
                return any("plain" in s.excluded and s.rids and plain_rid not in s.rids for s in switches())

            def until(what: str, cond: object, with_plain: bool = True) -> None:
                deadline = time.monotonic() + 90
                while not cond():  # type: ignore[operator]
                    assert time.monotonic() < deadline, f"timed out waiting for {what}: {switches()[-3:]}"
                    sync.update()
                    if with_plain:
                        conn.send("update")
                        receive(conn, 30, "plain update")

            with VllmWeightSync(llm, store=store, job=job, name="engine", fleet="mix", timeout_s=30) as sync:
                pusher = threading.Thread(target=push_every_few_ms, args=(sender,), daemon=True)
                pusher.start()
                try:
                    until("a switch with both", lambda: both_in())
                    pushes_at_stop = len(stalls)
                    os.kill(plain_pid, signal.SIGSTOP)
                    try:
                        until("plain left out", left_out_of_one, with_plain=False)
                        left_out = [s for s in switches() if "plain" in s.excluded and plain_rid not in s.rids][-1]
                        reason = left_out.excluded["plain"]
                        assert f"within timeout_s={timeout_s}" in reason or "not caught up" in reason, reason
                        checked: list[int] = []
                        deadline = time.monotonic() + 120
                        while len(checked) < 3 or sync.version < left_out.version + 10:  # type: ignore[operator]
                            assert time.monotonic() < deadline, f"the engine did not move on: {checked}"
                            applied = sync.update()
                            if applied is not None:
                                assert applied >= left_out.version
                                assert sync.state()[0]["fleet_switch"]["version"] >= applied
                                match = engine_matches(applied)
                                assert match is not False, f"the engine's tokens differ at version {applied}"
                                if match:
                                    checked.append(applied)
                        assert max(stalls[pushes_at_stop:]) < 0.5, "push() waited on the stopped receiver"
                    finally:
                        os.kill(plain_pid, signal.SIGCONT)
                    until("plain back in a switch", lambda: any(
                        plain_rid in s.rids and s.version > checked[-1] for s in switches()))  # fmt: skip
                    for _ in range(100):  # at one moment both hold the switched version again
                        sw = switches()[-1]
                        sync.update()
                        conn.send("update")
                        plain = receive(conn, 30, "plain update")[1:]
                        if switches()[-1] == sw and len(sw.rids) == 2 and plain_rid in sw.rids:
                            assert sync.version == plain[0] == sw.version, (sync.version, plain, sw)
                            assert plain[1] == digests[sw.version], f"plain receiver's bytes differ at {sw.version}"
                            assert engine_matches(sw.version) is not False, f"engine's tokens differ at {sw.version}"
                            break
                    else:
                        pytest.fail("no observation with both in the newest switch after SIGCONT")
                finally:
                    stop.set()
                    pusher.join(timeout=10)
                conn.send("stop")
    finally:
        llm.llm_engine.engine_core.shutdown()
