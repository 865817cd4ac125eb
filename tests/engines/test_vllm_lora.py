"""A PEFT/LoRA policy trained by Lightning pushes only its adapter; a real vLLM engine serves each
version as an in-memory adapter named by version (tiny local Llama, CPU, in-process engine).

After every push the engine's greedy tokens with that version's adapter must equal those of
transformers + PEFT holding the same adapter; versions older than the newest ``keep_adapters``
are dropped, the kept ones still answer as they did.
"""

from __future__ import annotations

import _vllm_only  # first: skips without vLLM
import pytest
import torch
from test_vllm_engine import NEW_TOKENS, PROMPTS, hf_greedy
from tiny_llama import write_tiny_llama

from lightning_wsync import WeightSender, WeightSyncCallback, WeightSyncError, WeightSyncSchemaError
from lightning_wsync.engines.lora import ADAPTER_TENSORS, lora_request
from lightning_wsync.engines.vllm import VllmWeightSync, make_llm

pytest.importorskip("peft", reason="peft: pip install 'lightning-wsync[vllm]' (.ci/vllm_venv.sh installs it)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 4
KEEP = 2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Policy(__import__("lightning").pytorch.LightningModule):
    """A peft model under a Lightning module; only the adapter trains (a loss that moves it fast)."""

    def __init__(self, model):
        super().__init__()
        self.policy = model

    def training_step(self, batch, batch_idx):
        return self.policy(input_ids=batch[0]).logits.float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.05)


class Check(__import__("lightning").pytorch.Callback):
    """After each push (listed after the WeightSyncCallback): the engine at that version's adapter
    generates what transformers + PEFT generates with the policy's weights at that step."""

    def __init__(self, sync: WeightSyncCallback, engine: VllmWeightSync, llm, prompts: list[list[int]]):
        self.sync, self.engine, self.llm, self.prompts = sync, engine, llm, prompts
        self.seen: dict[int, list[list[int]]] = {}
        self.wire_bytes = 0

    def engine_tokens(self, request) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in self.prompts], params,
                                 lora_request=request, use_tqdm=False)  # fmt: skip
        return [list(o.outputs[0].token_ids) for o in outs]

    def check(self, pl_module) -> None:
        version = self.sync.last_pushed_version
        if version is None or version in self.seen:
            return
        assert self.engine.wait_for_version(version, timeout_s=60) == version
        model = pl_module.policy
        model.eval()
        refs = [hf_greedy(model, ids) for ids in self.prompts]
        model.train()
        assert min(gap for _, gap in refs) > 1e-4, "near-tie in the reference; pick another seed"
        expected = [r for r, _ in refs]
        assert self.engine_tokens(self.engine.lora_request()) == expected, f"version {version}"
        self.seen[version] = expected
        assert self.sync.sender is not None
        self.wire_bytes = self.sync.sender.layout.total_bytes
        adapters = self.engine.state()[0]["adapters"]
        assert adapters == sorted(self.seen)[-KEEP:], adapters
        for kept in adapters[:-1]:  # an older version still loaded answers as it did
            assert self.engine_tokens(lora_request(kept)) == self.seen[kept], f"kept version {kept}"

    def on_train_start(self, trainer, pl_module) -> None:
        self.check(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.check(pl_module)


def test_a_peft_policy_pushes_its_adapter_and_the_engine_serves_each_version(tmp_path, port, server, monkeypatch):
    import lightning.pytorch as pl
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: starts in seconds
    path = write_tiny_llama(tmp_path / "model", init_std=0.5)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(p).input_ids[:48] for p in PROMPTS]
    llm = make_llm(path, dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20,
                   enable_lora=True, max_lora_rank=8, max_loras=KEEP, seed=0)  # fmt: skip
    store = f"127.0.0.1:{port}"  # hosted by the test (server): the engine joins before the trainer starts
    try:
        sync = WeightSyncCallback(every_n_steps=1, store=store, job="lora", timeout_s=60, include=ADAPTER_TENSORS)
        with VllmWeightSync(llm, store=store, job="lora", name="engine", verify=True, timeout_s=60,
                            lora=peft_model, keep_adapters=KEEP) as engine:  # fmt: skip
            check = Check(sync, engine, llm, prompts)
            data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor([prompts[0]] * STEPS)))
            trainer = pl.Trainer(max_steps=STEPS, callbacks=[sync, check], logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")  # fmt: skip
            trainer.fit(Policy(peft_model), data)

            assert sorted(check.seen) == list(range(STEPS + 1))
            assert check.seen[0] != check.seen[STEPS]  # training really changed what the adapter generates
            lora_bytes = sum(p.numel() * 4 for n, p in peft_model.named_parameters() if "lora_" in n)
            assert check.wire_bytes == lora_bytes  # the adapter only, never the base model

        # Refused in the worker, on the same engine: more adapters than it can hold, or a whole model.
        too_many = r"keep_adapters=3 must be between 1 and the engine's max_cpu_loras=2"
        with pytest.raises(WeightSyncError, match=too_many):
            VllmWeightSync(llm, store=store, job="lora", lora=peft_model, keep_adapters=3)
        with WeightSender(peft_model, store=store, job="whole", timeout_s=60):  # no include: the base model too
            with pytest.raises(WeightSyncSchemaError, match=r"would not load into the engine's LoRA layers: .*"
                               r"base_layer\.weight \(.*include=ADAPTER_TENSORS"):  # fmt: skip
                VllmWeightSync(llm, store=store, job="whole", lora=peft_model)
    finally:
        # Shut the in-process engine down here: left to the garbage collector, its shutdown runs
        # inside a later test and tears down vLLM's process-wide parallel groups under that test's engine.
        llm.llm_engine.engine_core.shutdown()


def test_lora_options_are_checked_before_any_worker_starts():
    with pytest.raises(ValueError, match=r"keep_adapters=0 must be an int >= 1"):
        VllmWeightSync(object(), lora={"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, keep_adapters=0)
    with pytest.raises(ValueError, match=r"lacks \['target_modules'\]"):
        VllmWeightSync(object(), lora={"r": 8, "lora_alpha": 16})
    with pytest.raises(ValueError, match=r"keep_adapters=2 without lora"):
        VllmWeightSync(object(), keep_adapters=2)


@_vllm_only.PROCESSES
def test_async_requests_keep_the_adapter_they_started_with_while_versions_land(tmp_path, port, children):
    """AsyncLLM, clients streaming while adapter versions are pushed: no pause, each request runs
    whole on its starting version's adapter (replayed with transformers + PEFT), the newest
    ``keep_adapters`` and those in use stay loaded."""
    import asyncio

    import psutil
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from lightning_wsync.engines.vllm import WORKER_EXTENSION
    from lightning_wsync.engines.vllm_async import AsyncVllmWeightSync

    path = write_tiny_llama(tmp_path / "model", init_std=0.5)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)
    trainer = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config).eval()
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(p).input_ids[:40] for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    args = AsyncEngineArgs(str(path), dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                           kv_cache_memory_bytes=64 << 20, enable_lora=True, max_lora_rank=8, max_loras=4,
                           worker_extension_cls=WORKER_EXTENSION)  # fmt: skip
    engine = AsyncLLM.from_engine_args(args)
    for child in psutil.Process().children(recursive=True):
        children.track(child.pid)
    adapters: dict[int, dict[str, torch.Tensor]] = {}
    g = torch.Generator().manual_seed(0)

    def next_adapter(version: int) -> None:
        with torch.no_grad():
            for name, p in trainer.named_parameters():
                if "lora_" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        adapters[version] = {n: p.clone() for n, p in trainer.named_parameters() if "lora_" in n}

    async def main() -> tuple[list, list]:
        with WeightSender(trainer, store=f"127.0.0.1:{port}", job="alora", timeout_s=60,
                          include=ADAPTER_TENSORS) as sender:  # fmt: skip
            sync = await AsyncVllmWeightSync.start(engine, store=f"127.0.0.1:{port}", job="alora", timeout_s=60,
                                                  lora=config, keep_adapters=1)  # fmt: skip
            try:
                finals, held = [], []
                streaming, finished = [True], asyncio.Event()

                async def client(c: int) -> None:
                    n = 0
                    while streaming[0]:
                        prompt = prompts[(c + n) % len(prompts)]
                        async for out in sync.generate({"prompt_token_ids": prompt}, params, f"c{c}-{n}"):
                            last = out
                        finals.append((prompt, last, sync.version))
                        finished.set()
                        n += 1

                next_adapter(0)
                sender.push(0)
                assert await sync.wait_for_version(0) == 0
                tasks = [asyncio.create_task(client(c)) for c in range(3)]
                for version in range(1, 5):
                    # Three requests end between versions (a step count was not enough on a quiet
                    # machine: every request then spanned two versions, and only 0 and 3 served any):
                    # the first client to finish starts its next request on the newest version.
                    ended = len(finals)
                    while len(finals) < ended + 3:
                        finished.clear()
                        await asyncio.wait_for(finished.wait(), 60)
                    next_adapter(version)
                    sender.push(version)
                    assert await sync.wait_for_version(version) == version
                    held.append((await sync.state())[0]["adapters"])
                streaming[0] = False
                await asyncio.wait_for(asyncio.gather(*tasks), 120)
                assert sync.paused_s == []  # adapters land between steps: the engine never paused
                return finals, held
            finally:
                await sync.close()

    try:
        finals, held = asyncio.run(main())
    finally:
        engine.shutdown()
    assert all(h[-1] == v for h, v in zip(held, range(1, 5)))
    assert all(len(h) <= 4 for h in held)  # keep_adapters=1 plus the versions requests still ran on
    assert all(o.exact and not o.switches for _, o, _ in finals)
    assert any(o.version < newest for _, o, newest in finals)  # a version landed while a request ran on an older one
    assert len({o.version for _, o, _ in finals}) >= 3
    expected: dict[tuple[int, int], list[int]] = {}  # (version, prompt): one reference each
    for prompt, out, _ in finals:
        key = (out.version, prompts.index(prompt))
        if key not in expected:
            reference.load_state_dict(adapters[out.version], strict=False)
            expected[key] = hf_greedy(reference, prompt)[0]
        assert list(out.output.outputs[0].token_ids) == expected[key], f"version {out.version}"
