"""The one place that picks a receiver's data plane for one sender epoch.

:func:`open_source` reads the sender's record: shared memory when the sender's ring is on
this host (:mod:`~lightning_wsync._planes.shm`), else the network link
(:mod:`~lightning_wsync._planes.net`). Relay hosts get theirs from
:mod:`~lightning_wsync._planes.relay.host`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from lightning_wsync._control.manifest import Manifest, dtype_to_name
from lightning_wsync._planes.base import ReceiveSource
from lightning_wsync._planes.net.link import NetReceiveLink
from lightning_wsync._planes.net.source import NetworkSource
from lightning_wsync._planes.shm.segment import ShmReader
from lightning_wsync._planes.shm.source import SharedMemorySource
from lightning_wsync.errors import WeightSyncConfigError, WeightSyncSchemaError

log = logging.getLogger(__name__)


def open_source(
    epoch: int,
    layout: Manifest,
    record: dict[str, object],
    ordered: list[torch.Tensor],
    *,
    host: str,
    name: str,
    net: Callable[[str], NetReceiveLink],
    swap: bool = False,
    fallback: bool = True,
) -> ReceiveSource:
    """The data plane the sender's record allows from this host.

    Same host by its host id, but the segment cannot be opened here (missing: another
    /dev/shm, as in a container on the host network; no permission; another user's):
    with ``transport='auto'`` and ``fallback``, the network path, said once in the log. A
    segment that opens but is not a wsync ring (a bad name, a symlink, not a regular file,
    no wsync header) stays a configuration error.
    """
    transport = str(record["transport"])
    backend = str(record["backend"])
    same_host = record["host"] == host and record["shm"] is not None
    if transport == "shm" and not same_host:
        raise WeightSyncConfigError(
            f"WeightReceiver {name!r}: the sender uses transport='shm' but runs on host "
            f"{record['host']!r}, not here ({host!r}); use transport='auto' or 'gloo' on the sender"
        )
    if transport in ("auto", "shm") and same_host:
        try:
            return SharedMemorySource(epoch, layout, ordered, ShmReader(str(record["shm"]), layout), name)
        except (FileNotFoundError, PermissionError) as exc:
            if transport == "shm" and isinstance(exc, PermissionError):
                raise WeightSyncConfigError(
                    f"WeightReceiver {name!r}: the sender uses transport='shm' but its segment {record['shm']!r} "
                    f"cannot be opened here ({exc.strerror}); run sender and receivers as one user, or use "
                    f"transport='auto' on the sender (the network path then serves this receiver)"
                ) from exc
            if transport == "shm" or not fallback:
                raise  # the segment is gone: that sender has ended
            log.warning(
                "receiver %r: cannot open the sender's shared-memory segment %r (%s); receiving over the network "
                "(%s) instead. Sender and receiver share a host id but not /dev/shm or a user (a container on the "
                "host network, another uid): run them in one IPC namespace as one user for the shared-memory "
                "path, or set a distinct WSYNC_HOST_ID per container to choose the network path without this "
                "warning", name, record["shm"], exc.strerror or exc, backend,
            )  # fmt: skip
    if swap:
        _check_swappable(layout, ordered, name, backend)
    return NetworkSource(epoch, layout, ordered, net(backend), swap=swap)


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


