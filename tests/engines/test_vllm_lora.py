"""A PEFT/LoRA policy trained by Lightning pushes only its adapter; a real vLLM engine serves each
version as an in-memory adapter named by version (tiny local Llama, CPU, in-process engine).

After every push the engine's greedy tokens with that version's adapter must equal those of
transformers + PEFT holding the same adapter; versions older than the newest ``keep_adapters``
are dropped, the kept ones still answer as they did.
"""

from __future__ import annotations

import _vllm_only  # noqa: F401  (first: skips without vLLM)
import pytest
import torch
from test_vllm_engine import NEW_TOKENS, PROMPTS, hf_greedy
from tiny_llama import write_tiny_llama

from lightning_wsync import WeightSyncCallback
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


def test_lora_options_are_checked_before_any_worker_starts():
    with pytest.raises(ValueError, match=r"keep_adapters=0 must be an int >= 1"):
        VllmWeightSync(object(), lora={"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, keep_adapters=0)
    with pytest.raises(ValueError, match=r"lacks \['target_modules'\]"):
        VllmWeightSync(object(), lora={"r": 8, "lora_alpha": 16})
    with pytest.raises(ValueError, match=r"keep_adapters=2 without lora"):
        VllmWeightSync(object(), keep_adapters=2)
