"""Which of the trainer's tensor names a vLLM worker's model would load.

vLLM models load checkpoint (Hugging Face) names through their own ``load_weights``:
its name mapping (``hf_to_vllm_mapper``), fused ``q/k/v -> qkv_proj`` and
``gate/up -> gate_up_proj``, and names it skips without a word (e.g. Llama's extra
``.bias``). The loaded model's parameters are already repacked for the CPU/GPU kernels,
so the check builds a second copy of the model on the meta device (no memory, a few
milliseconds) from the worker's own config, in this worker's tensor-parallel rank, and
feeds it one meta tensor per name: a name that raises or loads nothing would not load.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any, Protocol, cast

import torch
from torch import nn


class _VllmModel(Protocol):
    """What the check uses of a vLLM model class."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str] | None: ...

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]: ...


def _meta_model(vllm_config: Any) -> _VllmModel:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    config = copy.copy(vllm_config)  # attention layers register by name: a fresh registry for the copy
    config.compilation_config = copy.copy(config.compilation_config)
    config.compilation_config.static_forward_context = {}
    with set_current_vllm_config(config), torch.device("meta"):
        model = initialize_model(vllm_config=config)
    return cast(_VllmModel, model)


def check_names(vllm_config: Any, tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str]]:
    """(names the model would not load, each with why; model parameters no name reaches)."""
    model = _meta_model(vllm_config)
    refused: list[str] = []
    reached: set[str] = set()
    for name, tensor in tensors:
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        try:
            loaded = model.load_weights(iter([(name, meta)]))
        except (ValueError, KeyError, AssertionError, AttributeError) as exc:
            refused.append(f"{name} ({type(exc).__name__}: {str(exc)[:160]})")
            continue
        if not loaded:
            refused.append(f"{name} (skipped by {type(model).__name__}.load_weights)")
        reached.update(loaded or ())
    missing = sorted({n for n, _ in model.named_parameters()} - reached)
    return refused, missing
