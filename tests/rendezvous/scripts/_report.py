"""Shared by the scripts torchrun launches in the rendezvous tests.

Scripts report through JSON lines appended to ``<out>/events.jsonl`` (one short
``write`` per line, so concurrent writers do not interleave), which the test polls.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

ENV_KEYS = (
    "WSYNC_STORE",
    "WSYNC_JOB",
    "WSYNC_ROLE",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "GROUP_RANK",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WSYNC_HOST_ID",
)


def emit(out: Path, event: str, **fields: object) -> None:
    record = {
        "event": event,
        "pid": os.getpid(),
        "role": os.environ.get("WSYNC_ROLE"),
        "rank": os.environ.get("RANK"),
        "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
        **fields,
    }
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(out / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def env_snapshot() -> dict[str, str | None]:
    return {key: os.environ.get(key) for key in ENV_KEYS}


def make_policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def expected_state(module: nn.Module, version: int) -> dict[str, torch.Tensor]:
    """The weights the trainer holds at ``version``: a pattern unique per tensor and version."""
    state = {}
    for i, (name, tensor) in enumerate(sorted(module.state_dict().items())):
        values = torch.arange(tensor.numel(), dtype=tensor.dtype).reshape(tensor.shape)
        state[name] = values.mul_(1e-3).add_(version * 10 + i)
    return state


@torch.no_grad()
def set_version(module: nn.Module, version: int) -> None:
    expected = expected_state(module, version)
    for name, tensor in module.state_dict().items():
        tensor.copy_(expected[name])


def holds_version(module: nn.Module, version: int) -> bool:
    expected = expected_state(module, version)
    return all(
        torch.equal(tensor, expected[name])
        for name, tensor in module.state_dict().items()
    )
