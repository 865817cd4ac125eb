"""What the planes are opened from, in the shape every plane takes: a sender's
:class:`SenderSpec`, a receiver's :class:`ReceiverSpec`, and the :class:`ReceiveContext`
every plane's ``open_receive`` gets (the send side's context carries the sender's ring:
:mod:`~lightning_wsync._planes.sending`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.records import SenderRecord
from lightning_wsync._control.shards import ShardPlan
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import Timing, timing


@dataclass(frozen=True, kw_only=True)
class SenderSpec:
    """What a sender asks of its planes (from its :class:`~lightning_wsync.config.SenderConfig`)."""

    job: str
    epoch: int
    host: str
    addr: str
    transport: str  # auto | shm | gloo | nccl | nixl
    cross_host: str  # relay | chain | tree | star
    delta: str  # off | always | auto
    device: torch.device  # where the module's tensors are
    timeout_s: float
    heartbeat_timeout_s: float
    shards: ShardPlan | None = None  # sharded: this is trainer rank 0, its ring holds its share
    cuda_ipc: bool = False  # also keep the slots on the module's GPU, for same-host GPU receivers

    @property
    def timing(self) -> Timing:
        return timing(heartbeat_timeout_s=self.heartbeat_timeout_s, timeout_s=self.timeout_s)


@dataclass(frozen=True, kw_only=True)
class ReceiverSpec:
    """What a receiver brings to whichever plane serves it."""

    ctl: Control
    rid: int
    host: str
    name: str
    addr: str
    device: torch.device
    timeout_s: float
    swap: bool  # apply='swap': the module's tensors point at the staged buffer (network plane only)
    on_staged: Callable[[int], None]
    on_rejected: Callable[[int, str], None]
    newest: Callable[[], int | None]  # the newest version announced on the store
    on_rung: Callable[[], None] | None = None  # a relay host's leader: its bell rang (read the store's news)


@dataclass(frozen=True, kw_only=True)
class ReceiveContext:
    """What every plane's receive side is opened from: one sender epoch's record and this receiver."""

    epoch: int
    layout: Manifest
    record: SenderRecord
    ordered: list[torch.Tensor]
    me: ReceiverSpec
    fallback: bool
    same_host: bool  # the sender's host id is this one's and it keeps a segment
