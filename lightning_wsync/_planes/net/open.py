"""The network plane's row of the picker (:mod:`lightning_wsync._planes.open`): whether a
sender offers it (always), its send side and its receive side, each from one parameter object."""

from __future__ import annotations

import torch

from lightning_wsync._control.manifest import Manifest, dtype_to_name
from lightning_wsync._planes.net.link import NetReceiveLink
from lightning_wsync._planes.net.send import NetSendPlane
from lightning_wsync._planes.net.source import NetworkSource
from lightning_wsync._planes.params import ReceiveContext, SenderSpec
from lightning_wsync._planes.sending import SendContext
from lightning_wsync.errors import WeightSyncSchemaError

__all__ = ["offered", "open_receive", "open_send"]


def offered(spec: SenderSpec, from_device: bool) -> bool:
    """Every sender offers links: the network row serves every receiver the others do not."""
    return True


def open_send(side: SendContext) -> NetSendPlane:
    spec = side.spec
    return NetSendPlane(side.ctl, side.ring, epoch=spec.epoch, backend=side.backend, addr=spec.addr,
                        timing=side.timing, deltas=side.deltas, policy=side.policy)  # fmt: skip


def open_receive(side: ReceiveContext) -> NetworkSource:
    me, backend = side.me, side.record.backend
    if me.swap:
        _check_swappable(side.layout, side.ordered, me.name, backend)
    link = NetReceiveLink(
        me.ctl, side.layout, epoch=side.epoch, rid=me.rid, backend=backend, addr=me.addr, timeout_s=me.timeout_s,
        device=me.device if backend == "nccl" else torch.device("cpu"), on_staged=me.on_staged,
        on_rejected=me.on_rejected, newest=me.newest, pinned=backend == "gloo" and me.device.type == "cuda",
    )  # fmt: skip
    return NetworkSource(side.epoch, side.layout, side.ordered, link, swap=me.swap)


def _check_swappable(layout: Manifest, ordered: list[torch.Tensor], name: str, backend: str) -> None:
    """apply="swap" points tensors at the staging buffer: each must already be in its wire form."""
    want = torch.device("cpu") if backend == "gloo" else None
    for e, t in zip(layout.entries, ordered):
        device_ok = t.device == want if want is not None else t.device.type == "cuda"
        if t.dtype != e.wire_dtype or not device_ok:
            raise WeightSyncSchemaError(
                f"WeightReceiver {name!r}: apply='swap' needs every tensor as the {backend} link stages it, "
                f"but {e.name!r} is {dtype_to_name(t.dtype)} on {t.device} and arrives as "
                f"{dtype_to_name(e.wire_dtype)} on {want or 'the GPU'}; hold the module in the "
                f"wire dtype on that device, or use apply='copy'"
            )
