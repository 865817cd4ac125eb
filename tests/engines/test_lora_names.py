"""LoRA by version, the parts with no engine: tensor names as PEFT saves them, the adapter's config."""

from __future__ import annotations

import fnmatch

import pytest

from lightning_wsync.engines._worker.lora import peft_name
from lightning_wsync.engines.lora import ADAPTER_TENSORS, adapter_config, adapter_id, adapter_name, lora_options

NAMES = {  # a peft model under a LightningModule attribute, as the sender names its tensors
    "policy.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight":
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
    "base_model.model.model.layers.1.mlp.down_proj.lora_B.actor.weight":
        "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight",
    "base_model.model.model.embed_tokens.lora_embedding_A.default":
        "base_model.model.model.embed_tokens.lora_embedding_A",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":  # saved form: unchanged
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
}  # fmt: skip


def test_trainer_names_become_peft_checkpoint_names():
    assert {n: peft_name(n) for n in NAMES} == NAMES


def test_adapter_patterns_select_lora_tensors_and_no_base_weight():
    def selected(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in ADAPTER_TENSORS)

    assert all(selected(n) for n in NAMES)
    assert not selected("policy.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
    assert not selected("policy.base_model.model.lm_head.weight")


def test_adapter_config_is_plain_data_and_names_what_is_missing():
    config = adapter_config({"r": 8, "lora_alpha": 16, "target_modules": {"v_proj", "q_proj"}, "bias": "none"})
    assert config == {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    with pytest.raises(ValueError, match=r"lacks \['lora_alpha', 'target_modules'\]"):
        adapter_config({"r": 8})
    with pytest.raises(TypeError, match=r"lora=3 must be a peft model, a peft LoraConfig, or a mapping"):
        adapter_config(3)
    assert (adapter_name(7), adapter_id(7), adapter_id(0)) == ("wsync-v7", 8, 1)


def test_lora_options_are_checked():
    assert lora_options("X", None, None) == {}
    full = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    assert lora_options("X", full, 3) == {"lora": full, "keep_adapters": 3}
    with pytest.raises(ValueError, match=r"X: keep_adapters=0 must be an int >= 1"):
        lora_options("X", full, 0)
    with pytest.raises(ValueError, match=r"X: keep_adapters=True must be an int >= 1"):
        lora_options("X", full, True)
    with pytest.raises(ValueError, match=r"X: keep_adapters=2 without lora"):
        lora_options("X", None, 2)
