"""``AsyncLLM`` with requests streaming while versions are pushed: stamps replayed exactly.

Requests run the whole time; a new version is pushed and applied every few engine steps.
``pause_mode="keep"`` (KV kept): no request is aborted; ``"abort"``: in-flight requests
end at each update and keep the version that made their tokens. Every output's tokens
are replayed greedily with transformers: the stamped version at each token, with the KV
cache carried across a switch exactly as the engine keeps it.
"""

from __future__ import annotations

import asyncio

import _vllm_only  # first: skips without vLLM
import pytest
import torch
from test_vllm_engine import PROMPTS, perturb
from tiny_llama import write_tiny_llama

from lightning_wsync import WeightSender
from lightning_wsync.engines.vllm import WORKER_EXTENSION
from lightning_wsync.engines.vllm_async import AsyncVllmWeightSync, VersionedOutput

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), _vllm_only.PROCESSES]

TOKENS = 40
VERSIONS = range(1, 6)
CLIENTS = 4


def replay(model: torch.nn.Module, weights: dict[int, dict], prompt: list[int], out: VersionedOutput) -> None:
    """Greedy decoding with each token's stamped version; the KV cache kept across switches."""
    tokens = list(out.output.outputs[0].token_ids)
    cache, feed, loaded = None, prompt, None
    with torch.no_grad():
        for i, token in enumerate(tokens):
            version = out.version_of(i)
            if version != loaded:
                model.load_state_dict(weights[version])
                loaded = version
            step = model(input_ids=torch.tensor([feed]), past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            assert int(step.logits[0, -1].argmax()) == token, f"token {i} (version {version}, stamps {out.switches})"
            feed = [token]


@pytest.mark.parametrize("pause_mode", ["keep", "abort"])
def test_requests_stream_through_updates_and_say_which_version_made_each_token(tmp_path, port, children, pause_mode):
    import psutil
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    path = write_tiny_llama(tmp_path / "model", init_std=0.5)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(p).input_ids[:40] for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    args = AsyncEngineArgs(str(path), dtype="float32", enforce_eager=True, max_model_len=256,
                           kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False, seed=0,
                           worker_extension_cls=WORKER_EXTENSION)  # fmt: skip
    engine = AsyncLLM.from_engine_args(args)
    for child in psutil.Process().children(recursive=True):
        children.track(child.pid)
    weights: dict[int, dict[str, torch.Tensor]] = {}
    store = f"127.0.0.1:{port}"

    async def main() -> list[tuple[list[int], VersionedOutput]]:
        with WeightSender(trainer, store=store, job="async", timeout_s=60) as sender:
            sync = await AsyncVllmWeightSync.start(engine, store=store, job="async", name="engine", timeout_s=60,
                                                  pause_mode=pause_mode)  # fmt: skip
            try:
                weights[0] = {k: v.clone() for k, v in trainer.state_dict().items()}
                sender.push(0)
                assert await sync.wait_for_version(0) == 0
                progress, streaming = asyncio.Event(), [True]
                finals: list[tuple[list[int], VersionedOutput]] = []

                async def client(c: int) -> None:  # one request after another, until the last version
                    n = 0
                    while streaming[0]:
                        prompt = prompts[(c + n) % len(prompts)]
                        async for out in sync.generate({"prompt_token_ids": prompt}, params, f"c{c}-{n}"):
                            progress.set()
                            last = out
                        finals.append((prompt, last))
                        n += 1

                tasks = [asyncio.create_task(client(c)) for c in range(CLIENTS)]
                for version in VERSIONS:
                    for _ in range(4):  # a few engine steps between versions
                        progress.clear()
                        await asyncio.wait_for(progress.wait(), 60)
                    perturb(trainer, version)
                    weights[version] = {k: v.clone() for k, v in trainer.state_dict().items()}
                    sender.push(version)
                    assert await sync.wait_for_version(version) == version
                streaming[0] = False
                await asyncio.wait_for(asyncio.gather(*tasks), 120)
                assert len(sync.paused_s) == 1 + len(VERSIONS)  # one pause per version, 0 included
                return finals
            finally:
                await sync.close()

    try:
        outputs = asyncio.run(main())
    finally:
        engine.shutdown()
    finished = [o.output.outputs[0] for _, o in outputs]
    assert all(o.exact for _, o in outputs)  # final outputs: stamps from vLLM's label of each token
    switched_to = {v for _, o in outputs for _, v in o.switches}
    if pause_mode == "keep":
        assert all(f.finish_reason == "length" and len(f.token_ids) == TOKENS for f in finished)  # none aborted
        assert len(switched_to) >= 2, [o.switches for _, o in outputs]  # updates landed mid-request
    else:  # an aborted request keeps the version that made its tokens: none spans an update
        assert sum(f.finish_reason == "abort" for f in finished) >= 2
        assert not switched_to, [o.switches for _, o in outputs]
    assert {o.version for _, o in outputs} | switched_to == {0, *VERSIONS}  # every version generated tokens
    for prompt, out in outputs:
        replay(reference, weights, prompt, out)
