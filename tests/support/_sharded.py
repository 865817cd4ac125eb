"""A small model whose 2 MiB weight a sharded push cuts across two ranks, for the sharded tests."""

from __future__ import annotations

import torch
from torch import nn


def sharded_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 8))  # 2 MiB weight: cut across ranks
    model.register_buffer("steps", torch.arange(5, dtype=torch.int64))
    return model


def zeroed_sharded_model() -> nn.Module:
    """The same shapes, every tensor zero (a receiver's module before its first version)."""
    model = sharded_model()
    for t in model.state_dict().values():
        t.zero_()
    return model
