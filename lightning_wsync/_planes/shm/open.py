"""The shared-memory plane's row of the picker (:mod:`lightning_wsync._planes.open`): whether a
sender offers it, its send side and its receive side.

The send context (:class:`~lightning_wsync._planes.sending.SendContext`) carries objects of the
planes above this one (the delta streams), so this row reads it through :class:`RingSide`, the
two fields it needs; the receive side takes the one :class:`~lightning_wsync._planes.params.ReceiveContext`.
"""

from __future__ import annotations

import logging
from typing import Protocol

from lightning_wsync._control.store import Control
from lightning_wsync._planes.params import ReceiveContext, SenderSpec
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync._planes.shm.segment import ShmReader
from lightning_wsync._planes.shm.send import ShmSendPlane
from lightning_wsync._planes.shm.source import SharedMemorySource
from lightning_wsync.errors import WeightSyncConfigError

__all__ = ["RingSide", "offered", "open_receive", "open_send"]

log = logging.getLogger(__name__)


class RingSide(Protocol):
    """What the shared-memory row reads of the send context: the store and the sender's ring."""

    @property
    def ctl(self) -> Control: ...

    @property
    def ring(self) -> SnapshotRing: ...


def offered(spec: SenderSpec, from_device: bool) -> bool:
    return not from_device and spec.transport in ("auto", "shm", "nixl")


def open_send(side: RingSide) -> ShmSendPlane:
    return ShmSendPlane(side.ctl, side.ring)


def open_receive(side: ReceiveContext) -> SharedMemorySource | None:
    """The sender's ring on this host; None: another host, or a segment this receiver cannot open
    with ``transport='auto'`` and ``fallback`` (the network row then serves it, said once in the log)."""
    record, name, shm, transport = side.record, side.me.name, side.record.shm, side.record.transport
    if not side.same_host:
        if transport == "shm":
            raise WeightSyncConfigError(
                f"WeightReceiver {name!r}: the sender uses transport='shm' but runs on host "
                f"{record.host!r}, not here ({side.me.host!r}); use transport='auto' or 'gloo' on the sender"
            )
        return None
    if transport not in ("auto", "shm", "nixl"):
        return None
    try:
        return SharedMemorySource(side.epoch, side.layout, side.ordered, ShmReader(str(shm), side.layout), name)
    except (FileNotFoundError, PermissionError) as exc:
        if transport == "shm" and isinstance(exc, PermissionError):
            raise WeightSyncConfigError(
                f"WeightReceiver {name!r}: the sender uses transport='shm' but its segment {shm!r} "
                f"cannot be opened here ({exc.strerror}); run sender and receivers as one user, or use "
                f"transport='auto' on the sender (the network path then serves this receiver)"
            ) from exc
        if transport == "shm" or not side.fallback:
            raise  # the segment is gone: that sender has ended
        log.warning(
            "receiver %r: cannot open the sender's shared-memory segment %r (%s); receiving over the network "
            "(%s) instead. Sender and receiver share a host id but not /dev/shm or a user (a container on the "
            "host network, another uid): run them in one IPC namespace as one user for the shared-memory "
            "path, or set a distinct WSYNC_HOST_ID per container to choose the network path without this "
            "warning", name, shm, exc.strerror or exc, record.backend,
        )  # fmt: skip
        return None
