"""Opening a receiver's data plane on a host other than the sender's, when the sender relays:
the host ring (:class:`~lightning_wsync._planes.relay.mate.reader.RelaySource`) and the receiver's
member thread (:class:`~lightning_wsync._planes.relay.leader.member.RelayMember`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_wsync._control import keys
from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.records import SenderRecord, VersionRecord
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import timing
from lightning_wsync._planes.net.link import NetReceiveLink
from lightning_wsync._planes.net.source import NetworkSource
from lightning_wsync._planes.relay.leader.member import MemberSpec, RelayMember
from lightning_wsync._planes.relay.mate.reader import HostRingReader, RelaySource
from lightning_wsync.errors import WeightSyncError


def open_relay_source(
    control: Control, layout: Manifest, ordered: list[torch.Tensor], record: SenderRecord, *, epoch: int,
    rid: int, host: str, job: str, name: str, addr: str, timeout_s: float,
    on_published: Callable[[int], None], on_rejected: Callable[[int, str], None],
    on_rung: Callable[[], None] | None = None,
) -> RelaySource:  # fmt: skip
    """The data plane of a receiver on a host other than the sender's, when the sender relays
    (``on_rung``: see :class:`~lightning_wsync._planes.relay.leader.member.RelayMember`)."""
    backend = record.backend
    ctl = control.clone()

    def newest() -> int | None:  # read by the link only after timeout_s without an announcement
        try:
            latest = ctl.get_record(keys.LATEST, VersionRecord)
        except WeightSyncError:  # unreadable: as if not announced yet (the watcher reports it)
            return None
        return None if latest is None else latest.version

    def net() -> NetworkSource:
        link = NetReceiveLink(control, layout, epoch=epoch, rid=rid, backend=backend, addr=addr, timeout_s=timeout_s,
                              device=torch.device("cpu"), on_staged=on_published, on_rejected=on_rejected,
                              newest=newest)  # fmt: skip
        return NetworkSource(epoch, layout, ordered, link, swap=False)

    segment = HostRingReader(epoch, layout, ordered, name)
    source = RelaySource(epoch, segment, net)
    source.member = RelayMember(control, layout, segment, MemberSpec(
        epoch=epoch, rid=rid, host=host, job=job, backend=backend, nixl=record.transport == "nixl" and record.nixl,
        addr=addr,  # the sender's timeout_s: it bounds every hop, whatever this receiver's
        timing=timing(heartbeat_timeout_s=record.heartbeat_timeout_s, timeout_s=record.timeout_s),
        on_published=on_published, on_rejected=on_rejected, fall_back=source.fall_back, on_rung=on_rung,
    ))  # fmt: skip
    return source
