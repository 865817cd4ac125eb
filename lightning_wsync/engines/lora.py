"""LoRA adapters by version: a PEFT policy pushes only its adapter; engines serve each version.

The trainer selects the adapter tensors with the sender's ``include`` patterns (nothing
else changes on that side; the base model never travels)::

    from lightning_wsync.engines.lora import ADAPTER_TENSORS, adapter_config

    sync = WeightSyncCallback(every_n_steps=10, include=ADAPTER_TENSORS)   # policy wraps a peft model

The engine is created with LoRA on (``enable_lora=True``, ``max_lora_rank`` >= the
adapter's ``r``, ``max_loras`` / ``max_cpu_loras`` >= the versions to keep) and given the
adapter's config; each version becomes an in-memory adapter named ``wsync-v{version}``
(no file is written), and requests name the newest::

    llm = make_llm(base_model_dir, enable_lora=True, max_lora_rank=8, max_loras=2)
    with VllmWeightSync(llm, lora=adapter_config(peft_model)) as sync:
        sync.wait_for_version(0)
        llm.generate(prompts, params, lora_request=sync.lora_request())

Nothing here imports vLLM until :func:`lora_request` is called.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

ADAPTER_TENSORS = ["*.lora_A.*", "*.lora_B.*", "*.lora_embedding_A.*", "*.lora_embedding_B.*"]
"""``include=`` patterns that select a PEFT model's LoRA tensors (and nothing of the base model)."""

NAME_PREFIX = "wsync-v"


def adapter_name(version: int) -> str:
    """The adapter's name for ``version`` (its ``LoRARequest.lora_name``)."""
    return f"{NAME_PREFIX}{version}"


def adapter_id(version: int) -> int:
    """The adapter's integer id for ``version`` (vLLM's ids start at 1)."""
    return version + 1


def lora_request(version: int) -> Any:
    """The ``vllm.lora.request.LoRARequest`` that names ``version``'s in-memory adapter.

    Its ``lora_path`` (``wsync:v{version}``) is no file: vLLM reads it only to load an
    adapter it does not hold, and the engine holds this one for as long as it keeps it.
    """
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter_name(version), adapter_id(version), f"wsync:v{version}")


def adapter_config(config: object) -> dict[str, Any]:
    """The adapter's LoRA config as plain JSON data: from a ``peft.PeftModel`` (its active
    adapter), a ``peft.LoraConfig``, or a mapping such as ``adapter_config.json``'s contents.

    Raises:
        TypeError: ``config`` is none of those.
        ValueError: it lacks ``r``, ``lora_alpha`` or ``target_modules``.
    """
    try:
        from peft import PeftConfig, PeftModel
    except ImportError:  # without peft, only a mapping can be given
        pass
    else:
        if isinstance(config, PeftModel):
            config = config.peft_config[config.active_adapter]
        if isinstance(config, PeftConfig):
            config = config.to_dict()
    if not isinstance(config, Mapping):
        raise TypeError(
            f"lora={config!r} must be a peft model, a peft LoraConfig, or a mapping of its fields (adapter_config.json)"
        )
    plain = json.loads(json.dumps(dict(config), default=_plain))
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in plain]
    if missing:
        raise ValueError(f"lora: the adapter config lacks {missing!r} (have {sorted(plain)!r}); pass peft's LoraConfig")
    return dict(plain)


def _plain(value: object) -> object:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"lora: the adapter config holds {value!r}, which is not plain data")


def lora_options(owner: str, lora: object, keep_adapters: int | None) -> dict[str, Any]:
    """The worker options for ``lora`` / ``keep_adapters`` (none without ``lora``), checked."""
    if keep_adapters is not None and (isinstance(keep_adapters, bool) or not isinstance(keep_adapters, int)
                                      or keep_adapters < 1):  # fmt: skip
        raise ValueError(f"{owner}: keep_adapters={keep_adapters!r} must be an int >= 1 (None: the engine's max_loras)")
    if lora is None:
        if keep_adapters is not None:
            raise ValueError(f"{owner}: keep_adapters={keep_adapters!r} without lora=...; pass the adapter's config")
        return {}
    return {"lora": adapter_config(lora), "keep_adapters": keep_adapters}
