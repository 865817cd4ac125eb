"""In a vLLM worker: each staged version of a LoRA adapter becomes an in-memory adapter.

vLLM loads an adapter named by a request from its ``lora_path`` only when the worker does
not hold it: :class:`AdapterVersions` puts each version's tensors into the worker's LoRA
manager itself (``LoRAModel.from_lora_tensors``, then the manager's ``add_adapter``, which
packs q/k/v and gate/up as the model's layers need), under the id and name of
:func:`~lightning_wsync.engines.lora.lora_request`. It keeps the newest ``keep`` versions
and any version a request in flight still uses; older ones are removed, so vLLM's own LRU
(``max_cpu_loras``) never evicts one that a request may still name.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

import torch

from lightning_wsync.engines.lora import adapter_id
from lightning_wsync.errors import WeightSyncError

_ADAPTER_NAME = re.compile(r"\.(lora_A|lora_B)\.[^.]+\.weight$|\.(lora_embedding_A|lora_embedding_B)\.[^.]+$")
_PEFT_ROOT = "base_model.model."


def peft_name(name: str) -> str:
    """A trainer's tensor name as PEFT saves it: from ``base_model.model.`` on (whatever module
    wraps the peft model), without the adapter's name (``lora_A.default.weight`` -> ``lora_A.weight``)."""
    root = name.find(_PEFT_ROOT)
    if root > 0:
        name = name[root:]
    return _ADAPTER_NAME.sub(lambda m: f".{m[1]}.weight" if m[1] else f".{m[2]}", name)


class AdapterVersions:
    """The worker's adapters by version.

    Args:
        model_runner: the worker's ``model_runner`` (its ``lora_manager`` holds the adapters).
        config: the adapter's LoRA config (:func:`~lightning_wsync.engines.lora.adapter_config`).
        keep: how many of the newest versions stay loaded (None: the engine's ``max_loras``).
    """

    def __init__(self, model_runner: Any, config: Mapping[str, Any], keep: int | None) -> None:
        from vllm.lora.peft_helper import PEFTHelper

        if model_runner.vllm_config.lora_config is None:  # the runner has no lora_manager then
            raise WeightSyncError(
                "vLLM worker: lora=... needs an engine with LoRA on: create it with enable_lora=True, "
                f"max_lora_rank >= {config.get('r')!r} and max_loras >= the versions to keep"
            )
        manager = model_runner.lora_manager
        self._worker = manager
        self._manager = manager._adapter_manager
        lora_config = manager.lora_config
        capacity = int(lora_config.max_cpu_loras or lora_config.max_loras)
        self.keep = int(lora_config.max_loras) if keep is None else keep
        if not 1 <= self.keep <= capacity:
            raise WeightSyncError(
                f"vLLM worker: keep_adapters={keep!r} must be between 1 and the engine's max_cpu_loras={capacity} "
                f"(default max_loras); raise max_cpu_loras, or keep fewer"
            )
        self.capacity = capacity
        self.helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        try:
            self.helper.validate_legal(lora_config)
        except ValueError as exc:
            raise WeightSyncError(f"vLLM worker: the adapter does not fit the engine's LoRA settings: {exc}") from exc
        self.versions: list[int] = []  # loaded, oldest first

    def refused(self, names: Collection[str]) -> list[str]:
        """Names that would not load as this model's LoRA weights, each with why."""
        return refused_lora_names(self._manager, names)

    def add(self, version: int, tensors: Mapping[str, torch.Tensor], in_use: Collection[int] = ()) -> None:
        """Hold ``version`` as an adapter; drop versions beyond the newest ``keep`` not ``in_use``.

        Raises:
            WeightSyncError: keeping every version in use would pass ``max_cpu_loras`` (nothing changed).
        """
        from vllm.lora.lora_model import LoRAModel

        kept = [v for v in self.versions if v != version]
        held = set(kept[max(0, len(kept) - (self.keep - 1)) :] if self.keep > 1 else []) | (set(in_use) & set(kept))
        if len(held) + 1 > self.capacity:
            raise WeightSyncError(
                f"vLLM worker: version {version} would make {len(held) + 1} adapters (versions {sorted(held)!r} are "
                f"still in use) but max_cpu_loras={self.capacity}; raise max_cpu_loras and max_loras"
            )
        lora_config = self._worker.lora_config
        own = {peft_name(n): t.detach().clone() for n, t in tensors.items()}  # staged buffers are reused
        lora = LoRAModel.from_lora_tensors(
            adapter_id(version), own, self.helper, device="cpu", dtype=lora_config.lora_dtype,
            model_vocab_size=self._worker.vocab_size, weights_mapper=self._mapper(),
        )  # fmt: skip
        for old in kept:
            if old not in held:
                self._manager.remove_adapter(adapter_id(old))
        self._manager.remove_adapter(adapter_id(version))  # a version loaded again replaces itself
        self._manager.add_adapter(lora)
        self.versions = [v for v in kept if v in held] + [version]

    def _mapper(self) -> Any:
        return _rename_mapper(self._manager)


def refused_lora_names(manager: Any, names: Collection[str]) -> list[str]:
    """Names that would not load as LoRA weights of ``manager``'s model (vLLM's
    ``LoRAModelManager``), each with why."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    expected = set(manager.supported_lora_modules)
    for packed in manager.packed_modules_mapping.values():
        expected.update(packed)
    refused = []
    for name in names:
        try:
            module, _ = parse_fine_tuned_lora_name(peft_name(name), _rename_mapper(manager))
        except ValueError as exc:
            refused.append(f"{name} ({exc}; publish only the adapter: include=ADAPTER_TENSORS)")
            continue
        if module.rsplit(".", 1)[-1] not in expected:
            refused.append(f"{name} (no LoRA layer {module!r}; the engine's are {sorted(expected)!r})")
    return refused


def _rename_mapper(manager: Any) -> Any:
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)  # as vLLM's own adapter loader does
    return None if mapper is None else mapper.get_rename_mapper()
