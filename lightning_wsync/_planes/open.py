"""The one place that picks the data planes: a sender's (:class:`SendSide`) and,
for one sender epoch, a receiver's (:func:`open_source`).

A sender snapshots into a ring (in shared memory unless it sends from the GPU) and feeds
it to every plane it has: same-host readers (:mod:`~lightning_wsync._planes.shm`), a link
per receiver that asks for one (:mod:`~lightning_wsync._planes.net`), and the chain of host
leaders (:mod:`~lightning_wsync._planes.relay`). A receiver reads the sender's record
and takes the ring when it is on this host, its host's relay when the sender relays,
else its own network link. No other module branches on the transport.

Each plane's subpackage builds its own two ends (``<plane>/open.py``: ``offered``,
``open_send`` from one :class:`~lightning_wsync._planes.sending.SendContext`, ``open_receive``
from one :class:`~lightning_wsync._planes.params.ReceiveContext`); here are the table
:data:`PLANES`, one row per plane, the order a receiver tries them in, and the sharded push.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_wsync._control import keys
from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.records import SenderRecord, ShardsRecord
from lightning_wsync._control.shards import ShardPlan, Shares
from lightning_wsync._control.store import Control
from lightning_wsync._planes.base import MateNotes, ReceiveSource, SendPlane, Snapshots
from lightning_wsync._planes.delta.encode import AutoPolicy, DeltaStreams
from lightning_wsync._planes.net import open as net_plane
from lightning_wsync._planes.net.send import NetSendPlane
from lightning_wsync._planes.nixl import open as nixl_plane
from lightning_wsync._planes.params import ReceiveContext
from lightning_wsync._planes.params import ReceiverSpec as ReceiverSpec  # what a receiver brings (_pull)
from lightning_wsync._planes.params import SenderSpec as SenderSpec  # what a sender asks (_push)
from lightning_wsync._planes.relay import open as relay_plane
from lightning_wsync._planes.relay.head.streams import ShardStreamsPlane, relays_streams
from lightning_wsync._planes.relay.mate.notes import MateDesk
from lightning_wsync._planes.relay.sharded import open_sharded_relay
from lightning_wsync._planes.sending import SendContext
from lightning_wsync._planes.shard.send import ShardSendPlane
from lightning_wsync._planes.shard.source import open_rank_rings
from lightning_wsync._planes.shares import ShareWriter as ShareWriter  # the callback's ring of its share
from lightning_wsync._planes.shm import open as shm_plane
from lightning_wsync._planes.shm.cuda_ipc import mirror_device as mirror_device  # cuda_ipc=True: checked at once
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync._planes.shm.segment import ShmSegment, remove_stale_segments, segment_name
from lightning_wsync.config import SenderConfig
from lightning_wsync.errors import WeightSyncConfigError, WeightSyncSchemaError

log = logging.getLogger(__name__)


class SendSide:
    """A sender's snapshot ring and the planes that deliver from it."""

    def __init__(self, ctl: Control, layout: Manifest, spec: SenderSpec) -> None:
        self.shards: ShardPlan | None = None
        self.timing = spec.timing
        if spec.shards is not None:
            self._open_sharded(ctl, layout, spec, spec.shards)
            return
        from_device = spec.device.type == "cuda" and spec.transport == "nccl"
        offered = [row for row in PLANES if row.offered(spec, from_device)]  # before anything is made: may refuse
        names = {row.name for row in offered}
        segment = None
        if "shm" in names:
            remove_stale_segments()
            segment = ShmSegment(segment_name(spec.job, spec.epoch), layout.total_bytes, create=True, slots=2)
        self.segment = segment
        self.backend = "nccl" if from_device else "gloo"
        mirror = spec.device if spec.cuda_ipc and segment is not None else None
        self.ring = SnapshotRing(layout, segment=segment, device=spec.device if from_device else torch.device("cpu"),
                                 slots=2, lease_s=self.timing.pin_lease_s, mirror=mirror)  # fmt: skip
        self.holds: Snapshots = self.ring  # what a fleet round leases its target in
        # Deltas between ring slots, for network receivers and the relay (one encoding per base for all).
        self.deltas = DeltaStreams(layout) if spec.delta != "off" and not from_device else None
        side = SendContext(ctl=ctl, spec=spec, ring=self.ring, segment=segment, backend=self.backend,
                           timing=self.timing, deltas=self.deltas, policy=AutoPolicy(spec.delta))  # fmt: skip
        self.planes: tuple[SendPlane, ...] = tuple(row.open_send(side) for row in offered)
        net = self.planes[0]  # the network row: every sender offers it, first
        assert isinstance(net, NetSendPlane)
        self.net = net
        # What receivers read from the sender's record to pick their plane (open_source).
        self.record = SenderRecord(
            epoch=spec.epoch, host=spec.host, pid=os.getpid(), addr=spec.addr,
            heartbeat_timeout_s=spec.heartbeat_timeout_s, timeout_s=spec.timeout_s,  # timeout_s bounds every relay hop
            transport=spec.transport, backend=self.backend, relay="relay" in names,
            shm=segment.name if segment is not None else None, nixl="nixl" in names,
        )  # fmt: skip

    def _open_sharded(self, ctl: Control, layout: Manifest, spec: SenderSpec, plan: ShardPlan) -> None:
        """Rank 0 of a sharded push: a ring of its own share, and the plane watching every rank's."""
        if spec.transport not in ("auto", "shm", "nixl"):
            raise WeightSyncConfigError(
                f"WeightSender: a sharded push goes through shared memory, but transport={spec.transport!r}; "
                f"use transport='auto', 'shm' or 'nixl', or push unsharded (sharded=False)"
            )
        if spec.transport == "nixl" and spec.cross_host == "star":
            raise WeightSyncConfigError(
                "WeightSender: a sharded push reaches other hosts only through one relay stream per trainer rank, "
                "but transport='nixl' with cross_host='star' asks for one NIXL READ of the whole version per "
                "receiver; use cross_host='chain' or 'tree' (each rank's share READ hop by hop over NIXL), or push "
                "unsharded (sharded=False) for the star"
            )
        if spec.transport == "nixl" and (why := nixl_plane.unusable()) is not None:  # before anything is made
            raise WeightSyncConfigError(f"WeightSender: transport='nixl', but {why}; or use transport='auto'")
        shares = plan.share_layouts(layout)
        remove_stale_segments()
        segment = ShmSegment(segment_name(spec.job, spec.epoch), shares[0].total_bytes, create=True, slots=2)
        self.segment = segment
        self.backend = "gloo"
        self.ring = SnapshotRing(shares[0], segment=segment, device=torch.device("cpu"), slots=2,
                                 lease_s=self.timing.pin_lease_s,
                                 mirror=spec.device if spec.cuda_ipc else None)  # fmt: skip
        self.shards = plan = plan.with_segments([segment.name, *plan.segments[1:]])
        relay = relays_streams(spec.transport, spec.cross_host)
        nixl = spec.transport == "nixl"  # each stream's hops are NIXL READs of whole versions (docs/nixl.md)
        # rank 0's share's deltas (NIXL hops READ whole versions)
        self.deltas = DeltaStreams(shares[0]) if relay and not nixl and spec.delta != "off" else None
        watch = ShardSendPlane(ctl, self.ring, plan, shares, host=spec.host, epoch=spec.epoch,
                               timeout_s=spec.timeout_s, relayed=relay)  # fmt: skip
        self.holds = watch  # a fleet round holds its target in every rank's ring on this host
        planes: list[SendPlane] = [watch]
        if relay:  # every rank relays its own share to the other hosts (docs/sharded.md)
            planes.append(ShardStreamsPlane(
                ctl, self.ring, plan, epoch=spec.epoch, host=spec.host, backend=self.backend, addr=spec.addr,
                timing=self.timing, deltas=self.deltas, policy=AutoPolicy(spec.delta), topology=spec.cross_host,
                nixl=nixl, job=spec.job,
            ))  # fmt: skip
        self.planes = tuple(planes)
        self.record = SenderRecord(
            epoch=spec.epoch, host=spec.host, pid=os.getpid(), addr=spec.addr,
            heartbeat_timeout_s=spec.heartbeat_timeout_s, timeout_s=spec.timeout_s, transport=spec.transport,
            backend=self.backend, relay=relay, shm=segment.name, sharded=True, nixl=relay and nixl,
        )  # fmt: skip

    def stop(self) -> None:
        """Ask every plane's threads to end (:meth:`SendPlane.stop`: a send part-written at ``timeout_s``)."""
        for plane in self.planes:
            plane.stop()

    def close(self, deadline: float) -> list[str]:
        """Join the planes against ``deadline`` and free the ring; name what still runs."""
        stuck: list[str] = []
        try:
            self.ring.close()
            for plane in self.planes:
                stuck += plane.close(deadline)
            if self.deltas is not None:
                self.deltas.close(timeout_s=max(0.0, deadline - time.monotonic()))
        finally:
            if self.segment is not None:
                self.segment.close()
        return stuck


def open_source(
    epoch: int, layout: Manifest, record: SenderRecord, ordered: list[torch.Tensor], me: ReceiverSpec,
    *, fallback: bool = True,
) -> ReceiveSource:  # fmt: skip
    """The data plane the sender's record allows from this host: the first row of
    :data:`RECEIVE_ORDER` that serves it (the network link serves every receiver).

    Same host by its host id, but the segment cannot be opened here (missing: another
    /dev/shm, as in a container on the host network; no permission; another user's):
    with ``transport='auto'`` and ``fallback``, the network path, said once in the log. A
    segment that opens but is not a wsync ring (a bad name, a symlink, not a regular file,
    no wsync header) stays a configuration error.
    """
    if record.sharded:
        return _open_sharded(epoch, layout, record, ordered, me, fallback=fallback)
    side = ReceiveContext(epoch=epoch, layout=layout, record=record, ordered=ordered, me=me, fallback=fallback,
                          same_host=record.host == me.host and record.shm is not None)  # fmt: skip
    for name in RECEIVE_ORDER:
        if (source := _BY_NAME[name].open_receive(side)) is not None:
            return source
    raise AssertionError("the network row serves every receiver")


@dataclass(frozen=True)
class Plane:
    """One row of the table: whether a sender offers the plane, its send side, and its receive
    side (None: this row does not serve that receiver, the next row in :data:`RECEIVE_ORDER` may)."""

    name: str
    offered: Callable[[SenderSpec, bool], bool]  # (spec, sends from the GPU); may refuse (WeightSyncConfigError)
    open_send: Callable[[SendContext], SendPlane]
    open_receive: Callable[[ReceiveContext], ReceiveSource | None]


# The table of planes, in the order a sender opens (and closes) them. Adding a plane is a row here,
# its subpackage (with its open.py), a config value and a record field.
PLANES: tuple[Plane, ...] = (
    Plane("net", net_plane.offered, net_plane.open_send, net_plane.open_receive),
    Plane("shm", shm_plane.offered, shm_plane.open_send, shm_plane.open_receive),
    Plane("relay", relay_plane.offered, relay_plane.open_send, relay_plane.open_receive),
    Plane("nixl", nixl_plane.offered, nixl_plane.open_send, nixl_plane.open_receive),
)
_BY_NAME = {row.name: row for row in PLANES}
RECEIVE_ORDER = ("relay", "nixl", "shm", "net")  # a receiver takes the first row that serves it


def _open_sharded(
    epoch: int, layout: Manifest, record: SenderRecord, ordered: list[torch.Tensor], me: ReceiverSpec, *,
    fallback: bool = True,
) -> ReceiveSource:  # fmt: skip
    """Every trainer rank's ring of a sharded sender: its own on this host, else its relayed stream's (also,
    with ``fallback``, the stream of a rank on this host whose ring cannot be mapped here)."""
    shards = me.ctl.get_record(keys.shards(epoch), ShardsRecord)
    if shards is None:
        raise WeightSyncConfigError(
            f"WeightReceiver {me.name!r}: sender epoch {epoch} is sharded but published no plan"
        )
    plan = shards.plan
    try:
        plan.check(layout)
    except ValueError as exc:
        raise WeightSyncConfigError(f"WeightReceiver {me.name!r}: sender epoch {epoch}'s shard plan: {exc}") from exc
    for t in ordered:
        if not t.is_contiguous():
            raise WeightSyncSchemaError(
                f"WeightReceiver {me.name!r}: a sharded push is written into contiguous tensors, but a tensor of "
                f"shape {tuple(t.shape)} is not; make the rollout module's tensors contiguous"
            )
    hosts = plan.rank_hosts(record.host)
    if all(h == me.host for h in hosts):
        try:
            return open_rank_rings(epoch, layout, plan, ordered, me.name)
        except (FileNotFoundError, PermissionError):
            if not record.relay or not fallback:
                raise
            # Some ring cannot be mapped here: the ranks' streams serve this receiver as a host of its own.
    if not record.relay:
        away = sorted({h for h in hosts if h != me.host})
        raise WeightSyncConfigError(
            f"WeightReceiver {me.name!r}: the trainer pushes sharded with no relay (transport={record.transport!r}, "
            f"cross_host='star' or transport='shm'), which reaches receivers on the trainer ranks' hosts only: ranks "
            f"run on {away!r}, not here "
            f"({me.host!r}); use transport='auto' with cross_host='relay' or 'chain' on the trainer (each rank "
            f"then relays its share to every host), or sharded=False"
        )
    return open_sharded_relay(
        me.ctl, layout, plan, ordered, record, epoch=epoch, rid=me.rid, host=me.host, job=me.ctl.job, name=me.name,
        addr=me.addr, on_published=me.on_staged, on_rejected=me.on_rejected, fallback=fallback,
    )  # fmt: skip


def open_share_writer(shares: Shares, config: SenderConfig) -> ShareWriter:
    """A trainer rank's (other than 0) ring of its share of a sharded push, in shared memory."""
    return ShareWriter(shares, config)


def open_mate_notes() -> MateNotes:
    """A receiver's notes to its relay host's leader (used only while a source's host link offers a board)."""
    return MateDesk()
