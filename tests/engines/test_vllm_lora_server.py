"""A PEFT/LoRA policy trained by Lightning pushes only its adapter; a real vLLM server (CPU) serves
each version as an in-memory adapter named ``wsync-v{N}`` (no file), keeping the newest two.

The server's command line is vLLM's own (``--enable-lora ...``, the ``wsync`` backend) with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` for vLLM's adapter routes. After every push, greedy
``/v1/completions`` with ``model="wsync-v{N}"`` must equal transformers + PEFT at that step, the
version before still answers as it did, and the base model is untouched; at the end the
versions pushed out are refused by name, and a load of one of them says which versions the
server holds.
"""

from __future__ import annotations

import _vllm_only  # first: skips without vLLM
import pytest
import requests
import torch
from _vllm_server import Server
from conftest import free_port
from test_vllm_engine import NEW_TOKENS, PROMPTS, hf_greedy
from test_vllm_lora import TARGETS, Policy
from tiny_llama import write_tiny_llama

from lightning_wsync import WeightSyncCallback
from lightning_wsync.engines.lora import ADAPTER_TENSORS, adapter_name
from lightning_wsync.engines.vllm_callback import VllmServersCallback

pytest.importorskip("peft", reason="peft: pip install 'lightning-wsync[vllm]' (.ci/vllm_venv.sh installs it)")
# The server alone can take minutes to start here.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), _vllm_only.PROCESSES]

STEPS = 3
KEEP = 2
START_S = 600


class Check(__import__("lightning").pytorch.Callback):
    """After each version the servers hold (listed after the VllmServersCallback): the server, asked
    for that version's adapter by name, generates what transformers + PEFT generates now."""

    def __init__(self, follow: VllmServersCallback, server: Server, prompts: list[list[int]]):
        self.follow, self.server, self.prompts = follow, server, prompts
        self.seen: dict[int, list[list[int]]] = {}
        self.wire_bytes = 0

    def served(self, version: int) -> list[list[int]]:
        return [self.server.complete(ids, NEW_TOKENS, model=adapter_name(version)) for ids in self.prompts]

    def check(self, pl_module) -> None:
        version = self.follow.version
        if version is None or version in self.seen:
            return
        model = pl_module.policy
        model.eval()
        refs = [hf_greedy(model, ids) for ids in self.prompts]
        model.train()
        assert min(gap for _, gap in refs) > 1e-4, "near-tie in the reference; pick another seed"
        assert self.server.weight_version() == str(version)
        assert self.served(version) == [r for r, _ in refs], f"version {version}"
        self.seen[version] = [r for r, _ in refs]
        assert self.follow.sync.sender is not None
        self.wire_bytes = self.follow.sync.sender.layout.total_bytes
        models = requests.get(f"{self.server.url}/v1/models", timeout=30).json()["data"]
        assert sorted(m["id"] for m in models if m["id"].startswith("wsync-")) == [
            adapter_name(v) for v in sorted(self.seen)[-KEEP:]
        ]
        for kept in sorted(self.seen)[-KEEP:-1]:  # the version before still answers as it did
            assert self.served(kept) == self.seen[kept], f"kept version {kept}"

    def on_train_start(self, trainer, pl_module) -> None:
        self.check(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.check(pl_module)


def test_a_server_serves_each_adapter_version_by_name_and_refuses_those_pushed_out(tmp_path):
    import lightning.pytorch as pl
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_tiny_llama(tmp_path / "model", init_std=0.5)
    server = Server(path, free_port(), tmp_path / "server.log", extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
                    args=["--enable-lora", "--max-lora-rank", "8", "--max-loras", str(KEEP),
                          "--max-cpu-loras", str(KEEP)])  # fmt: skip
    try:
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(path)
        prompts = [tok(p).input_ids[:48] for p in PROMPTS]
        base_tokens = [hf_greedy(base, ids)[0] for ids in prompts]  # before peft wraps (and trains) it
        peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
        server.wait_ready(START_S)

        sync = WeightSyncCallback(every_n_steps=1, store=f"127.0.0.1:{free_port()}", job="lora-server", timeout_s=60,
                                  include=ADAPTER_TENSORS)  # fmt: skip
        follow = VllmServersCallback(
            sync, [server.url], timeout_s=60, server_options={"lora": peft_model, "keep_adapters": KEEP, "verify": True}
        )
        check = Check(follow, server, prompts)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor([prompts[0]] * STEPS)))
        trainer = pl.Trainer(max_steps=STEPS, callbacks=[sync, follow, check], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             accelerator="cpu")  # fmt: skip
        trainer.fit(Policy(peft_model), data)

        assert sorted(check.seen) == list(range(STEPS + 1))
        assert len({tuple(map(tuple, s)) for s in check.seen.values()}) == STEPS + 1  # each version answered apart
        lora_bytes = sum(p.numel() * 4 for n, p in peft_model.named_parameters() if "lora_" in n)
        assert check.wire_bytes == lora_bytes  # the adapter only, never the base model
        assert [server.complete(ids, NEW_TOKENS) for ids in prompts] == base_tokens  # the base never written

        for old in range(STEPS + 1 - KEEP):  # pushed out: refused at admission, by vLLM, with its name
            body = {"model": adapter_name(old), "prompt": prompts[0], "max_tokens": 4}
            response = requests.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 404, response.text
            assert f"The model `{adapter_name(old)}` does not exist" in response.json()["error"]["message"]
        # Named again by hand, a version the workers dropped is refused by them, saying which they hold.
        load = {"lora_name": "again-v0", "lora_path": "wsync:v0"}
        response = requests.post(f"{server.url}/v1/load_lora_adapter", json=load, timeout=60)
        assert response.status_code >= 400
        held = list(range(STEPS + 1))[-KEEP:]
        assert f"(version 0) is not held by this server: it keeps the newest {KEEP} versions, now {held!r}" in (
            response.text
        )
        assert requests.get(f"{server.url}/health", timeout=30).ok  # the refusal left the engine serving
        # A held version named again is built afresh from the same tensors; three adapters in vLLM's LRU
        # of two (--max-cpu-loras) evict one, and the next request on it rebuilds it: same tokens each time.
        again = {"lora_name": "again-v3", "lora_path": f"wsync:v{STEPS}"}
        requests.post(f"{server.url}/v1/load_lora_adapter", json=again, timeout=60).raise_for_status()
        for name, version in [("again-v3", STEPS), (adapter_name(STEPS - 1), STEPS - 1), (adapter_name(STEPS), STEPS)]:
            assert server.complete(prompts[1], NEW_TOKENS, model=name) == check.seen[version][1], name
    finally:
        server.stop()
