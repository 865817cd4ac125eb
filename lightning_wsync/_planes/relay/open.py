"""The relay plane's row of the picker (:mod:`lightning_wsync._planes.open`): whether a sender
offers it, its send side (the head, :mod:`.head`) and its receive side on a host other than the
sender's (the host ring and the receiver's member thread, :mod:`.receive`), each from one
parameter object."""

from __future__ import annotations

import logging

from lightning_wsync._planes.base import ReceiveSource
from lightning_wsync._planes.nixl.open import stream_shape
from lightning_wsync._planes.params import ReceiveContext, SenderSpec
from lightning_wsync._planes.relay.head.plane import RelaySendPlane
from lightning_wsync._planes.relay.hops import Stream
from lightning_wsync._planes.relay.receive import open_relay_source
from lightning_wsync._planes.sending import SendContext

__all__ = ["offered", "open_receive", "open_send"]

log = logging.getLogger(__name__)


def offered(spec: SenderSpec, from_device: bool) -> bool:
    return spec.transport in ("auto", "nixl") and spec.cross_host != "star" and not from_device


def open_send(side: SendContext) -> RelaySendPlane:
    spec = side.spec
    nixl = spec.transport == "nixl"  # its hops are NIXL READs, down a chain or one tree (nixl/hop.py)
    stream = Stream(number=spec.epoch, backend=side.backend, addr=spec.addr, timeout_s=side.timing.timeout_s,
                    nixl=nixl)  # fmt: skip
    shape = stream_shape(spec.cross_host) if nixl else spec.cross_host  # NIXL: one tree, or a chain
    return RelaySendPlane(side.ctl, side.ring, stream, host=spec.host, timing=side.timing, deltas=side.deltas,
                          policy=side.policy, topology=shape,
                          previous_epoch=spec.epoch - 1 or None)  # fmt: skip


def open_receive(side: ReceiveContext) -> ReceiveSource | None:
    """This host's relay source; None: the sender does not relay, or runs on this host."""
    me, record = side.me, side.record
    if not record.relay or record.host == me.host:
        return None
    if me.swap:
        log.warning(
            "receiver %r: apply='swap' has no effect on a relay host (versions are copied from the host's "
            "shared memory); the sender's cross_host='star' keeps the network path", me.name,
        )  # fmt: skip
    return open_relay_source(
        me.ctl, side.layout, side.ordered, record, epoch=side.epoch, rid=me.rid, host=me.host, job=me.ctl.job,
        name=me.name, addr=me.addr, timeout_s=me.timeout_s, on_published=me.on_staged, on_rejected=me.on_rejected,
        on_rung=me.on_rung,
    )  # fmt: skip
