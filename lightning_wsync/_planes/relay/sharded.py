"""A sharded push across hosts, receive side: one relayed stream per trainer rank, assembled here.

For each trainer rank on another host, this receiver stands in that rank's stream (a
:class:`~lightning_wsync._planes.relay.leader.member.RelayMember` under the stream number, see
:mod:`~lightning_wsync._planes.relay.head.streams`): the stream's leader on this host receives
the rank's share into a host ring of its own, verified against the rank's signed trailer.
A rank on this host is read from its own ring. Every receiver of the host then assembles
whole versions from those rings exactly as on the trainer's host
(:class:`~lightning_wsync._planes.shard.source.ShardedSource`): the newest version complete
in every ring, pinned in all of them, never a mix.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator

import torch

from lightning_wsync._control import keys
from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.records import SenderRecord
from lightning_wsync._control.shards import ShardPlan
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import timing
from lightning_wsync._planes.relay.leader.member import MemberSpec, RelayMember
from lightning_wsync._planes.relay.mate.board import Posted, read_board
from lightning_wsync._planes.relay.mate.reader import open_leader_ring
from lightning_wsync._planes.shard.source import FixedRing, ShardedSource, ShareRing
from lightning_wsync._planes.shm.files import SHM_DIR, pin_dir
from lightning_wsync._planes.shm.segment import ShmReader

log = logging.getLogger(__name__)


class StreamRing:
    """One stream's host ring, as that stream's leader on this host names it (its member calls :meth:`follow`)."""

    def __init__(self, share: Manifest) -> None:
        self._share = share
        self._segment: str | None = None
        self._reader: ShmReader | None = None
        self._lock = threading.Lock()

    def follow(self, segment: str | None, *, ready: bool = False) -> str | None:
        """Read ``segment`` from now on; why it cannot be opened when its leader says it exists (``ready``)."""
        with self._lock:  # never while a copy holds the old one
            if segment != self._segment or self._reader is None:
                old, self._reader, self._segment = self._reader, None, segment
                if old is not None:
                    old.close()
                if segment is not None:
                    self._reader, why = open_leader_ring(segment, self._share, ready=ready)
                    self._segment = segment if self._reader is not None else None
                    return why
            return None

    def following(self) -> str | None:
        return self._segment if self._reader is not None else None

    def board(self) -> Posted | None:
        """The stream leader's board (:mod:`.mate.board`): its age is the leader's beat."""
        segment = self.following()
        return None if segment is None else read_board(pin_dir(os.path.join(SHM_DIR, segment)))

    @contextlib.contextmanager
    def held(self) -> Iterator[ShmReader | None]:
        with self._lock:
            yield self._reader

    def close(self) -> None:
        self.follow(None)


def open_sharded_relay(
    control: Control, layout: Manifest, plan: ShardPlan, ordered: list[torch.Tensor], record: SenderRecord, *,
    epoch: int, rid: int, host: str, job: str, name: str, addr: str,
    on_published: Callable[[int], None], on_rejected: Callable[[int, str], None],
) -> ShardedSource:  # fmt: skip
    """The data plane of a receiver of a sharded sender whose ranks are not all on this host."""
    shares = plan.share_layouts(layout)
    rings: list[ShareRing] = []
    members: list[RelayMember] = []
    holder: list[ShardedSource] = []

    def published(version: int) -> None:  # a stream's share is in; the version is staged once all are
        if holder and (newest := holder[0].newest_complete()) is not None:
            on_published(newest)

    def fall_back(why: str) -> None:
        log.error("receiver %r: a stream of the sharded sender cannot reach it (%s); there is no network path "
                  "for a sharded push, so it applies no version of sender epoch %d", name, why, epoch)  # fmt: skip

    try:
        for rank, (share, rank_host) in enumerate(zip(shares, plan.rank_hosts(record.host))):
            if rank_host == host:
                rings.append(FixedRing(plan.segments[rank], share))
                continue
            ring = StreamRing(share)
            rings.append(ring)
            members.append(RelayMember(control, share, ring, MemberSpec(
                epoch=keys.relay_stream(epoch, rank), rid=rid, host=host, job=job,
                backend=record.backend, addr=addr,  # the sender's timeout_s: it bounds every hop
                timing=timing(heartbeat_timeout_s=record.heartbeat_timeout_s, timeout_s=record.timeout_s),
                on_published=published, on_rejected=on_rejected,
                fall_back=fall_back,
            )))  # fmt: skip
    except BaseException:
        for member in members:
            member.close()
        for done in rings:
            done.close()
        raise
    source = ShardedSource(
        epoch, layout, plan, shares, ordered, name, rings, owned=[m.close for m in members],
        describe=f"relay across hosts, sharded over {plan.world} trainer ranks ({len(members)} streams relayed)",
        verify=True,  # with ReceiverConfig.verify, also against every rank's checksums as rank 0 publishes them
    )  # fmt: skip
    holder.append(source)
    return source
