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
from lightning_wsync._planes.nixl.agent import unusable
from lightning_wsync._planes.relay.alone import alone_host, leave_alone, stand_alone
from lightning_wsync._planes.relay.leader.member import MemberSpec, RelayMember
from lightning_wsync._planes.relay.mate.board import Posted, read_board
from lightning_wsync._planes.relay.mate.reader import open_leader_ring
from lightning_wsync._planes.shard.source import FixedRing, ShardedSource, ShareRing
from lightning_wsync._planes.shm.files import SHM_DIR, pin_dir
from lightning_wsync._planes.shm.segment import ShmReader
from lightning_wsync.errors import WeightSyncConfigError

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


class _Members:
    """This receiver's members of the streams it gets relayed, including those it stands alone in."""

    def __init__(self, control: Control, shares: list[Manifest], record: SenderRecord, *,
                 epoch: int, rid: int, host: str, job: str, name: str, addr: str,
                 on_published: Callable[[int], None], on_rejected: Callable[[int, str], None]) -> None:  # fmt: skip
        self._control, self._shares, self._record = control, shares, record
        self._epoch, self._rid, self._host, self._job, self._name, self._addr = epoch, rid, host, job, name, addr
        self._on_published, self._on_rejected = on_published, on_rejected
        self._own = alone_host(host, rid)
        self._lock = threading.Lock()  # a member's thread adds the one that replaces it
        self._members: list[RelayMember] = []
        self._alone: set[int] = set()  # the ranks whose streams this receiver gets as a host of its own
        self._closed = False

    def stand(self, rank: int, ring: StreamRing, member_host: str) -> None:
        """Stand in rank ``rank``'s stream on ``member_host`` (this host's, or this receiver's own)."""
        member = RelayMember(self._control, self._shares[rank], ring, MemberSpec(
            epoch=keys.relay_stream(self._epoch, rank), rid=self._rid, host=member_host, job=self._job,
            backend=self._record.backend, addr=self._addr,  # the sender's timeout_s: it bounds every hop
            nixl=self._record.transport == "nixl" and self._record.nixl,  # a leader READs the stream over NIXL
            timing=timing(heartbeat_timeout_s=self._record.heartbeat_timeout_s, timeout_s=self._record.timeout_s),
            on_published=self._on_published, on_rejected=self._on_rejected,
            fall_back=lambda why: self.alone(rank, ring, why, member_host, said=True),
        ))  # fmt: skip
        self._members.append(member)

    def alone(self, rank: int, ring: StreamRing, why: str, member_host: str, *, said: bool = False) -> None:
        """Rank ``rank``'s share cannot reach this receiver through its host's ring: as a host of its own.
        ``said``: the member that gave up warned already (this is then said at INFO, for the rank)."""
        if member_host == self._own:  # its own ring failed as well: nothing else to try
            log.error("receiver %r: trainer rank %d's share cannot reach it (%s), not even as a host of its own; "
                      "it applies no version of sender epoch %d", self._name, rank, why, self._epoch)  # fmt: skip
            return
        log.log(logging.INFO if said else logging.WARNING,
                "receiver %r: cannot map this host's ring of trainer rank %d's share (%s); it receives that rank's "
                "stream over the network into a ring of its own instead (one more copy into this host). Run "
                "host-mates in one IPC namespace as one user to share one copy", self._name, rank, why)  # fmt: skip
        with self._lock:
            if self._closed:
                return
            self._alone.add(rank)
            stand_alone(self._control, keys.relay_stream(self._epoch, rank), self._rid, self._own)
            self.stand(rank, ring, self._own)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            members = list(self._members)
        for member in members:
            member.close()
        for rank in sorted(self._alone):
            leave_alone(self._control, keys.relay_stream(self._epoch, rank), self._rid)


def open_sharded_relay(
    control: Control, layout: Manifest, plan: ShardPlan, ordered: list[torch.Tensor], record: SenderRecord, *,
    epoch: int, rid: int, host: str, job: str, name: str, addr: str,
    on_published: Callable[[int], None], on_rejected: Callable[[int, str], None], fallback: bool = True,
) -> ShardedSource:  # fmt: skip
    """The data plane of a receiver of a sharded sender whose ranks are not all on this host, or whose
    rings on this host it cannot all map (with ``fallback``, it then gets those ranks' streams relayed,
    standing alone: :mod:`~lightning_wsync._planes.relay.alone`)."""
    if record.transport == "nixl" and record.nixl and (why := unusable()) is not None:
        raise WeightSyncConfigError(
            f"WeightReceiver {name!r}: the trainer relays each rank's share over NIXL (transport='nixl'), and "
            f"every receiver on a rollout host may lead its host's hops, but {why}; install it here, or run the "
            f"trainer with transport='auto' (gloo hops)"
        )
    shares = plan.share_layouts(layout)
    rings: list[ShareRing] = []
    holder: list[ShardedSource] = []

    def published(version: int) -> None:  # a stream's share is in; the version is staged once all are
        if holder and (newest := holder[0].newest_complete()) is not None:
            on_published(newest)

    members = _Members(control, shares, record, epoch=epoch, rid=rid, host=host, job=job, name=name, addr=addr,
                       on_published=published, on_rejected=on_rejected)  # fmt: skip
    try:
        for rank, rank_host in enumerate(plan.rank_hosts(record.host)):
            if rank_host == host:
                try:
                    rings.append(FixedRing(plan.segments[rank], shares[rank]))
                    continue
                except (FileNotFoundError, PermissionError) as exc:
                    if not fallback:
                        raise
                    rings.append(ring := StreamRing(shares[rank]))
                    members.alone(rank, ring, f"trainer rank {rank}'s ring {plan.segments[rank]!r}: "
                                              f"{exc.strerror or exc}", host)  # fmt: skip
                    continue
            rings.append(ring := StreamRing(shares[rank]))
            members.stand(rank, ring, host)
    except BaseException:
        members.close()
        for done in rings:
            done.close()
        raise
    relayed = sum(not isinstance(r, FixedRing) for r in rings)
    source = ShardedSource(
        epoch, layout, plan, shares, ordered, name, rings, owned=[members.close],
        describe=f"relay across hosts, sharded over {plan.world} trainer ranks ({relayed} streams relayed)",
        verify=True,  # with ReceiverConfig.verify, also against every rank's checksums as rank 0 publishes them
    )  # fmt: skip
    holder.append(source)
    return source
