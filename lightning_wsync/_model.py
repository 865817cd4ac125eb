"""What the callback reads of Lightning's model and strategy: which strategies it supports,
the submodule it pushes, and the CPU mirror of gathered weights that the sender reads."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from torch import nn

SUPPORTED = "single device, DDPStrategy (ddp, ddp_spawn, ...), FSDPStrategy, ModelParallelStrategy (FSDP2)"


class MirrorModule(nn.Module):
    """Holds CPU copies of gathered weights under their original names, for the sender."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                child = owner._modules.get(part)
                if child is None:
                    child = nn.Module()
                    owner.add_module(part, child)
                owner = child
            owner.register_buffer(leaf, tensor)


def mirror_of(target: nn.Module, full: dict[str, torch.Tensor], mirror: dict[str, torch.Tensor]) -> nn.Module:
    """Fill ``mirror`` with CPU copies of ``full``, tied where ``target``'s tensors are tied.

    Receivers list a tied tensor once, under its first name; the mirror must do the same.
    """
    identity: dict[str, int] = {}
    named = [*target.named_parameters(remove_duplicate=False), *target.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        # FSDP1 (use_orig_params) inserts its wrapper into names; state-dict names omit it.
        identity[name.replace("_fsdp_wrapped_module.", "")] = id(tensor)
    first: dict[int, str] = {}
    for name, tensor in full.items():
        key = identity.get(name)
        tied = name if key is None else first.setdefault(key, name)
        mirror[name] = mirror[tied] if tied != name else tensor.detach().to("cpu", copy=True)
    return MirrorModule(mirror)


def submodule(pl_module: pl.LightningModule, path: str | None) -> nn.Module:
    if path is None:
        return pl_module
    owner: nn.Module = pl_module
    walked: list[str] = []
    for part in path.split("."):
        child = getattr(owner, part, None)  # getattr: FSDP1 wrappers forward attributes
        if not isinstance(child, nn.Module):
            where = ".".join(walked) or type(pl_module).__name__
            children = sorted(name for name, _ in owner.named_children())
            raise ValueError(
                f"WeightSyncCallback: module={path!r}: {where} has no submodule {part!r}; its submodules are "
                f"{children!r}; pass one of them (dotted for deeper ones), or module=None for the whole model"
            )
        walked.append(part)
        owner = child
    return owner


def is_sharded(strategy: Strategy) -> bool:
    if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
        return True
    if isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        raise ValueError(
            f"WeightSyncCallback: strategy {type(strategy).__name__!r} is not supported; use one of: {SUPPORTED}"
        )
    if strategy.root_device.type not in ("cpu", "cuda"):
        raise ValueError(f"WeightSyncCallback: device {strategy.root_device!s} is not supported; train on CPU or CUDA")
    return False


def as_tensor(name: str, value: object) -> torch.Tensor:
    assert isinstance(value, torch.Tensor), f"state-dict entry {name!r} is a {type(value).__name__}, not a tensor"
    return value
