"""The NIXL plane's row of the picker (:mod:`lightning_wsync._planes.open`): whether a sender
offers it, its send side and its receive side, each from one parameter object; nothing else of
this package is called from above it.

The row's ``open_send``/``open_receive`` read the picker's contexts and call
:func:`send_plane`/:func:`receive_source`, which take this plane's own parameter objects
(:class:`NixlSendParams`, :class:`NixlReceiveParams`)."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.store import Control
from lightning_wsync._planes.nixl.agent import NixlError, unusable
from lightning_wsync._planes.nixl.receive import NixlReader, NixlSource, module_device
from lightning_wsync._planes.nixl.send import NixlSendPlane
from lightning_wsync._planes.params import ReceiveContext, SenderSpec
from lightning_wsync._planes.sending import SendContext
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync._planes.shm.segment import ShmSegment
from lightning_wsync.errors import WeightSyncConfigError

__all__ = ["NixlReceiveParams", "NixlSendParams", "lend_share", "offered", "open_receive", "open_send",
           "receive_source", "send_plane", "stream_shape", "unusable"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20  # one READ; the owner's lease is renewed as each lands


@dataclass(frozen=True, kw_only=True)
class NixlSendParams:
    ctl: Control
    ring: SnapshotRing
    segment: ShmSegment  # the ring's slots: registered as they are, READ in place
    epoch: int
    job: str
    mirror: tuple[torch.Tensor, ...] = ()  # the ring's GPU mirror (cuda_ipc=True): lent too, as VRAM


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


def offered(spec: SenderSpec, from_device: bool) -> bool:
    """transport='nixl', or 'auto' with cross_host='star' where NIXL is usable; says which."""
    if from_device:
        return False
    if spec.transport == "nixl":
        if (refused := unusable()) is not None:
            raise WeightSyncConfigError(f"WeightSender: transport='nixl', but {refused}; or use transport='auto'")
        return True
    if spec.transport != "auto" or spec.cross_host != "star":
        return False
    why = unusable()
    if why is None:
        log.info("WeightSender: transport='auto', cross_host='star': receivers on other hosts READ through NIXL")
    else:
        log.info("WeightSender: transport='auto', cross_host='star': receivers on other hosts get gloo links (%s)", why)
    return why is None


def open_send(side: SendContext) -> NixlSendPlane:
    assert side.segment is not None  # offered only with the shared-memory row
    return send_plane(NixlSendParams(ctl=side.ctl, ring=side.ring, segment=side.segment, epoch=side.spec.epoch,
                                     job=side.spec.job, mirror=tuple(side.ring.mirror or ())))  # fmt: skip


def open_receive(side: ReceiveContext) -> NixlSource | None:
    """A reader of the sender's ring; None: not offered to this receiver, or NIXL is not usable
    here and the sender also serves gloo links (transport='auto'), said once in the log."""
    me, record = side.me, side.record
    if not record.nixl or side.same_host:
        return None
    why = unusable()
    if why is not None and record.transport == "auto":
        log.warning("receiver %r: the sender offers NIXL, but %s; receiving over a gloo link instead", me.name, why)
        return None
    return receive_source(NixlReceiveParams(
        ctl=me.ctl, layout=side.layout, ordered=side.ordered, epoch=side.epoch, rid=me.rid, name=me.name,
        timeout_s=me.timeout_s, newest=me.newest, on_staged=me.on_staged, on_rejected=me.on_rejected,
    ))  # fmt: skip


def send_plane(p: NixlSendParams) -> NixlSendPlane:
    """The owner's side. Raises WeightSyncConfigError when NIXL cannot be used here."""
    why = unusable()
    if why is not None:
        raise WeightSyncConfigError(f"WeightSender: transport='nixl', but {why}; or use transport='auto' or 'gloo'")
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", p.job)[:32]
    try:
        return NixlSendPlane(p.ctl, p.ring, p.segment, epoch=p.epoch, name=f"wsync-s{p.epoch}-{os.getpid()}-{safe}",
                             mirror=p.mirror)  # fmt: skip
    except NixlError as exc:
        raise WeightSyncConfigError(f"WeightSender: transport='nixl': {exc}") from None


def lend_share(ctl: Control, ring: SnapshotRing, *, stream: int, job: str, who: str) -> NixlSendPlane:
    """A trainer rank's share ring lent to the first leader of its relay stream (a sharded push with
    ``transport='nixl'``, docs/nixl.md): the owner's record is ``nixl/<stream>/agent/sender``, and the
    trailers it signs for hop readers name the stream, as the gloo relay's do. ``who`` names the caller
    in the error raised when NIXL cannot be used here (WeightSyncConfigError)."""
    why = unusable()
    if why is not None:
        raise WeightSyncConfigError(f"{who}: transport='nixl' (a sharded push relays each trainer rank's share "
                                    f"over NIXL), but {why}; or use transport='auto'")  # fmt: skip
    assert ring.segment is not None  # a share ring is in shared memory
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:32]
    try:
        return NixlSendPlane(ctl, ring, ring.segment, epoch=stream, name=f"wsync-s{stream}-{os.getpid()}-{safe}")
    except NixlError as exc:
        raise WeightSyncConfigError(f"{who}: transport='nixl': {exc}") from None


def stream_shape(cross_host: str) -> str:
    """The shape of a relay whose hops are NIXL READs: one tree (``cross_host='tree'``: an owner serves any
    number of readers) or a chain (``'relay'`` and ``'chain'``; the push-time model's pick is for gloo hops)."""
    return "tree" if cross_host == "tree" else "chain"


def receive_source(p: NixlReceiveParams) -> NixlSource:
    """A reader of the sender's ring. Raises WeightSyncConfigError when NIXL cannot be used here."""
    why = unusable()
    if why is not None:
        raise WeightSyncConfigError(f"WeightReceiver {p.name!r}: the sender offers NIXL, but {why}")
    try:
        reader = NixlReader(p.ctl, p.layout, epoch=p.epoch, rid=p.rid, timeout_s=p.timeout_s,
                            chunk_bytes=p.chunk_bytes, newest=p.newest, on_staged=p.on_staged,
                            on_rejected=p.on_rejected, device=module_device(p.ordered))  # fmt: skip
    except NixlError as exc:
        raise WeightSyncConfigError(f"WeightReceiver {p.name!r}: {exc}") from None
    return NixlSource(p.epoch, p.ordered, reader)
