"""The NIXL plane's two entries, each from one parameter object: what the picker
(:mod:`lightning_wsync._planes.open`) calls, and nothing else of this package."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.store import Control
from lightning_wsync._planes.nixl.agent import NixlError, unusable
from lightning_wsync._planes.nixl.receive import NixlReader, NixlSource
from lightning_wsync._planes.nixl.send import NixlSendPlane
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync._planes.shm.segment import ShmSegment
from lightning_wsync.errors import WeightSyncConfigError

__all__ = ["NixlReceiveParams", "NixlSendParams", "open_receive", "open_send", "unusable"]

CHUNK_BYTES = 16 << 20  # one READ; the owner's lease is renewed as each lands


@dataclass(frozen=True, kw_only=True)
class NixlSendParams:
    ctl: Control
    ring: SnapshotRing
    segment: ShmSegment  # the ring's slots: registered as they are, READ in place
    epoch: int
    job: str


@dataclass(frozen=True, kw_only=True)
class NixlReceiveParams:
    ctl: Control
    layout: Manifest
    ordered: list[torch.Tensor]
    epoch: int
    rid: int
    name: str
    timeout_s: float
    newest: Callable[[], int | None]
    on_staged: Callable[[int], None]
    on_rejected: Callable[[int, str], None]
    chunk_bytes: int = CHUNK_BYTES


def open_send(p: NixlSendParams) -> NixlSendPlane:
    """The owner's side. Raises WeightSyncConfigError when NIXL cannot be used here."""
    why = unusable()
    if why is not None:
        raise WeightSyncConfigError(f"WeightSender: transport='nixl', but {why}; or use transport='auto' or 'gloo'")
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", p.job)[:32]
    try:
        return NixlSendPlane(p.ctl, p.ring, p.segment, epoch=p.epoch, name=f"wsync-s{p.epoch}-{os.getpid()}-{safe}")
    except NixlError as exc:
        raise WeightSyncConfigError(f"WeightSender: transport='nixl': {exc}") from None


def open_receive(p: NixlReceiveParams) -> NixlSource:
    """A reader of the sender's ring. Raises WeightSyncConfigError when NIXL cannot be used here."""
    why = unusable()
    if why is not None:
        raise WeightSyncConfigError(f"WeightReceiver {p.name!r}: the sender offers NIXL, but {why}")
    try:
        reader = NixlReader(p.ctl, p.layout, epoch=p.epoch, rid=p.rid, timeout_s=p.timeout_s,
                            chunk_bytes=p.chunk_bytes, newest=p.newest, on_staged=p.on_staged,
                            on_rejected=p.on_rejected)  # fmt: skip
    except NixlError as exc:
        raise WeightSyncConfigError(f"WeightReceiver {p.name!r}: {exc}") from None
    return NixlSource(p.epoch, p.ordered, reader)
