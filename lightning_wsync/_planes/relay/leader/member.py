"""A rollout host of the relay: each receiver's member thread (elect, lead, relay) and its data plane.

Election is in :mod:`~lightning_wsync._planes.relay.leader.elect`, the host ring (and the
network fallback) in :mod:`~lightning_wsync._planes.relay.mate.reader`, the chain in
:mod:`~lightning_wsync._planes.relay.head.feed`; the leader's hops (receive, rebuild, verify,
forward) are in :mod:`~lightning_wsync._planes.relay.leader.hop` and :mod:`~lightning_wsync._planes.relay.down`.

Longer than 300 lines: one member's whole life on its host (standing, leading a chain or the
trees, following a leader) in one thread, whose steps share its state.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_wsync._control import keys
from lightning_wsync._control.host import pid_alive, pid_namespace
from lightning_wsync._control.manifest import Manifest, entry_views
from lightning_wsync._control.records import LeaderRecord, Receipt, ReceiptsRecord
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import Timing
from lightning_wsync._planes.nixl.hop import ChainHop as NixlChainHop
from lightning_wsync._planes.relay import exits
from lightning_wsync._planes.relay.down import Downstream
from lightning_wsync._planes.relay.hops import (
    CHAIN_POLL_S,
    POLL_S,
    Chain,
    Stream,
    Superseded,
    error_text,
    join_hop,
)
from lightning_wsync._planes.relay.leader.bell import Bell
from lightning_wsync._planes.relay.leader.elect import Election
from lightning_wsync._planes.relay.leader.hop import ChainHop, HopReceiver, Message
from lightning_wsync._planes.relay.leader.treehop import TreeLead
from lightning_wsync._planes.relay.mate.board import Board, HostNews, Posted, read_board
from lightning_wsync._planes.relay.mate.notes import MateRelay
from lightning_wsync._planes.relay.mate.reader import RingFollower
from lightning_wsync._planes.relay.tidy import forget_hop
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync._planes.shm.segment import ShmSegment, remove_stale_segments, segment_name
from lightning_wsync._planes.wire import PeerGroup, close_group
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)

_RECEIPTS = 8  # versions a leader reports how it got (push reports read them)


@dataclass(frozen=True, kw_only=True)
class MemberSpec:
    """What a :class:`RelayMember` is made with, besides its store, layout and ring: the stream it
    follows, the receiver it serves, and what it tells that receiver (a parameter object, as
    :class:`~lightning_wsync._planes.relay.hops.Stream`)."""

    epoch: int  # the stream's number: the sender's epoch, or one trainer rank's stream (keys.relay_stream)
    rid: int
    host: str
    job: str
    backend: str  # the hops' process groups: gloo | nccl
    addr: str  # where the hops meet (the sender's address)
    timing: Timing  # from the sender's record: its timeout_s bounds every hop, whatever this receiver's
    on_published: Callable[[int], None]
    on_rejected: Callable[[int, str], None]
    fall_back: Callable[[str], None]
    # Called while this receiver leads, whenever its bell rings (a new chain, a takeover, the sender's
    # close or a new sender, the bell's backstop), and as it starts leading: its watcher reads the
    # store's ``news`` then, not on a poll of its own.
    on_rung: Callable[[], None] | None = None
    nixl: bool = False  # the sender's transport='nixl': this leader READs from upstream (nixl/hop.py)


class RelayMember:
    """A rollout receiver on a host other than the sender's: elects, leads, relays.

    One named thread: every ``CHAIN_POLL_S`` it reads the host's leader record, takes
    over when the leader is gone or silent, points the :class:`HostRingReader` at the
    leader's segment, and while this receiver leads, runs the hop loop (receive from
    upstream, forward downstream, publish into the host segment). When this receiver
    cannot create the host segment (as leader) or open its leader's, it resigns and stands
    no more, and ``fall_back(reason)`` serves it another way (over the network).
    """

    def __init__(self, control: Control, layout: Manifest, segment: RingFollower, spec: MemberSpec) -> None:
        epoch, rid, host, timing = spec.epoch, spec.rid, spec.host, spec.timing
        self.layout = layout
        self.segment = segment
        self.published_version: int | None = None
        self._control = control
        self._epoch = epoch
        self._rid = rid
        self._host = host
        self._backend = spec.backend
        self._addr = spec.addr
        self._nixl = spec.nixl
        self._nixl_hop: NixlChainHop | None = None  # while leading with transport='nixl'
        self._timing = timing
        self._timeout_s = timing.timeout_s
        self._heartbeat_timeout_s = timing.heartbeat_timeout_s
        self._on_published = spec.on_published
        self._on_rejected = spec.on_rejected
        self._fall_back = spec.fall_back
        self._on_rung = spec.on_rung
        # Unique to this member: simulated hosts may share a process or /dev/shm, and a restarted
        # container reuses PIDs while a SIGKILLed predecessor's segment may still be there.
        shm = segment_name(f"{keys.host_key(host)}{secrets.token_hex(4)}-relay-{spec.job}", epoch)
        self._election = Election(epoch=epoch, host=host, rid=rid, shm=shm, timing=timing)
        self._own: SnapshotRing | None = None
        self._board: Board | None = None  # while leading: what host-mates read instead of the store
        self._mates: MateRelay | None = None  # while leading: the host-mates' beats and acks, to the store
        self._bell: Bell | None = None  # while leading: the chain and its leadership, without polls
        self._leader: LeaderRecord | None = None  # as last read from the store, which is read again
        self._store_due, self._pidns = 0.0, pid_namespace()  # at _store_due whatever the host says
        self._suspect: tuple[int, str] | None = None  # (rid, why) the host itself says the leader is gone
        self._hop: HopReceiver | None = None  # while leading: staging, and the version it holds
        self._receipts: dict[int, Receipt] = {}
        self._notes = 0  # ready notes written on the current hop from upstream
        self._failed_chain: int | None = None  # the chain number whose hop from upstream failed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"wsync-relay-r{rid}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ctl = self._control.clone()
        while not self._stop.is_set() and self._election.standing:
            try:
                self._step(ctl)
            except Exception as exc:  # noqa: BLE001 - the relay must outlive any one bad step
                if not self._stop.is_set():
                    log.warning("relay: receiver rid=%d step failed: %s", self._rid, error_text(exc))
                    self._stop.wait(CHAIN_POLL_S)
        self._step_down()
        try:  # a leader that leaves takes its record and receipts with it (the store stays bounded)
            self._election.resign(ctl)
            if self._receipts:
                ctl.delete(keys.relay_received(self._epoch, self._rid))
        except Exception as exc:  # noqa: BLE001 - the store may be gone with the job
            log.debug("relay: receiver rid=%d left its keys: %s", self._rid, error_text(exc))

    @property
    def leads(self) -> bool:
        """The one answer to "does this process lead its host": it holds the host's ring."""
        return self._own is not None

    def post(self, news: HostNews) -> None:
        if (board := self._board) is not None:
            board.post(news)

    def own_board(self) -> Posted | None:
        board = self._board
        return None if board is None else read_board(os.path.dirname(board.path))

    def _leader_live_here(self) -> bool:
        """Whether the leader whose ring this host-mate reads looks live from the host (its board's
        age; its PID, from its own PID namespace), asking the store nothing; when not, and every
        ``timing.leader_record_backstop_s`` anyway, the member reads the leader's record from the store."""
        record, self._suspect = self._leader, None
        if (record is None or record.rid == self._rid or time.monotonic() >= self._store_due
                or self.segment.following() != record.shm
                or (record.pidns != 0 and record.pidns == self._pidns and not pid_alive(record.pid))):  # fmt: skip
            return False
        posted = self.segment.board()
        if posted is not None and posted.age_s > self._heartbeat_timeout_s:
            self._suspect = (record.rid, f"leader rid={record.rid} silent on the host for {posted.age_s:.1f} s "
                                         f"(heartbeat_timeout_s={self._heartbeat_timeout_s})")  # fmt: skip
        return posted is not None and self._suspect is None

    def _step(self, ctl: Control) -> None:
        if self._own is None and self._leader_live_here():
            self._stop.wait(CHAIN_POLL_S)
            return
        record = self._leader  # a leader's bell reads its record again when rung, and every few seconds
        # A suspect is what this step's look at the host found (as a host-mate), used once: kept, it
        # named a leader of long ago when this receiver, leading meanwhile, lost the host and read its
        # record again, and it took the host straight back from a live host-mate (issue 32).
        suspect, self._suspect = self._suspect, None
        if self._bell is None or not self._bell.named or record is None:
            record = self._leader = self._election.elect(ctl, suspect=suspect)
            self._store_due = time.monotonic() + self._timing.leader_record_backstop_s
        leading = record is not None and record.rid == self._rid
        if record is not None and leading and self._own is None:
            if not self._create_ring(ctl, record.shm):
                return
        elif record is not None and leading and not record.ready:  # took its own record back (it was garbled)
            self._election.mark_ready(ctl)
        unreadable = None if record is None else self.segment.follow(record.shm, ready=record.ready or leading)
        if record is not None and unreadable is not None and self._election.read(ctl)[1] == record:
            self._give_up(ctl, f"cannot open its leader's (rid={record.rid}) host segment {record.shm!r} "
                               f"({unreadable})", how="run host-mates in one IPC namespace as one user, or give "
                               "each container its own WSYNC_HOST_ID (it is then a relay host of its own)")  # fmt: skip
        elif leading:
            self._lead(ctl)  # returns when the chain changes, a hop fails, or leadership is lost
        else:
            self._step_down()
            self._stop.wait(CHAIN_POLL_S)

    def _create_ring(self, ctl: Control, name: str) -> bool:
        try:
            remove_stale_segments()  # a SIGKILLed predecessor's ring, among others
            segment = ShmSegment(name, self.layout.total_bytes, create=True, slots=2)
        except (OSError, WeightSyncError) as exc:
            self._give_up(ctl, f"cannot create the host segment {name!r} as its leader ({exc})",
                          how="it resigned so that a host-mate leads")  # fmt: skip
            return False
        self._own = SnapshotRing(self.layout, segment=segment, device=torch.device("cpu"), slots=2,
                                 lease_s=self._timing.host_ring_lease_s)  # fmt: skip
        self._board = Board(segment.pin_dir, self._timing.board_beat_s, self._rid)
        self._mates = MateRelay(self._control, self._board, period_s=self._timing.mates_flush_s, rid=self._rid)
        # Ready before the bell first reads the record: marked after, the bell's next look found it
        # changed with no ring and rang once more per leadership (~6 requests).
        self._election.mark_ready(ctl)
        self._bell = Bell(self._control, self._election, epoch=self._epoch, rid=self._rid, timing=self._timing)
        if self._on_rung is not None:
            self._bell.listen(self._on_rung)
            self._on_rung()  # a new leader reads news at once: its host-mates read it off its board
        self._hop = HopReceiver(self.layout, self._own)  # read as a chain (ChainHop) or a tree (TreeLead)
        return True

    def _give_up(self, ctl: Control, why: str, *, how: str) -> None:
        """Stand no more (resigning if leading) and be served another way; said once."""
        self._election.standing = False
        self._step_down()
        self._election.resign(ctl)
        self.segment.follow(None)
        log.warning("relay: receiver rid=%d on host %s %s; it receives over the network from the sender "
                    "instead (one more copy into this host); %s", self._rid, self._host, why, how)  # fmt: skip
        self._fall_back(why)

    def _step_down(self) -> None:
        for part in (self._mates, self._board, self._bell):
            if part is not None:
                part.close()
        self._mates, self._board, self._bell = None, None, None
        if self._nixl_hop is not None:
            self._nixl_hop.close()
            self._nixl_hop = None
        if self._own is not None:
            self.segment.follow(None)
            self._own.close()
            if self._own.segment is not None:
                self._own.segment.close()
            self._own = None
            self._hop = None

    # -- leading ------------------------------------------------------------------
    def _lead_nixl(self, ctl: Control, chain: Chain, superseded: Callable[[], bool]) -> None:
        """Lead this chain or tree by NIXL READs from the upstream leader's registered ring."""
        assert self._own is not None and self._own.segment is not None
        pos = chain.rids.index(self._rid)
        # A chain: the previous leader; a tree: the parent in the binary heap over the leaders (one tree,
        # each leader READs the whole version: a READ's owner serves any number of readers).
        up = chain.rids[(pos - 1) // 2 if chain.tree else pos - 1] if pos else None
        if self._nixl_hop is None:  # one per leadership: chains change its upstream, not its agents
            self._nixl_hop = NixlChainHop(ctl, self.layout, self._own, self._own.segment, stream=self._epoch,
                                          rid=self._rid, upstream=up, timeout_s=self._timeout_s,
                                          on_accepted=self._published, on_rejected=self._on_rejected,
                                          have=self.published_version)  # fmt: skip
        self._nixl_hop.lead(up, superseded)

    def _lead(self, ctl: Control) -> None:
        bell = self._bell
        assert bell is not None
        chain = bell.chain  # read when its bell rings (a new chain, a takeover) and every few seconds
        if chain is None or self._rid not in chain.rids or chain.number == self._failed_chain:
            # A hop whose group was built and then failed cannot be joined again (its keys name
            # the old peer, maybe stalled: joining would block for timeout_s); its sender marked it
            # broken, so the chain is re-formed under a new number. One whose peer never came is.
            self._stop.wait(CHAIN_POLL_S)
            bell.current(-1)  # (asking drives the bell's backstop ring)
            return

        def superseded() -> bool:
            return self._stop.is_set() or not bell.current(chain.number)

        if self._nixl and self._own is not None and self._own.segment is not None:  # READs from upstream (nixl/hop.py)
            self._lead_nixl(ctl, chain, superseded)
            return
        if chain.tree:
            hop = self._hop
            assert hop is not None
            lead = TreeLead(ctl, hop, chain, self._stream(), rid=self._rid, stop=self._stop,
                            current=bell.current)  # fmt: skip
            deaf = bell.listen(lead.nudge)
            try:
                if lead.serve(superseded, lambda msg: self._accept(ctl, hop, msg)):
                    self._failed_chain = chain.number
            finally:
                deaf()
            return
        pos = chain.rids.index(self._rid)
        self._notes = 0
        up_prefix = keys.relay_hop_prefix(self._epoch, chain.number, self._rid)
        nxt = chain.rids[pos + 1] if pos + 1 < len(chain.rids) else None
        down = Downstream(ctl, self._stream(), chain, nxt, self.layout, current=bell.current)
        deaf, pg = bell.listen(down.nudge), None  # a ring makes its reader look at once
        try:
            pg = join_hop(ctl, up_prefix, 1, self._backend, self._addr, self._timeout_s, superseded)
            self._serve(ctl, pg, up_prefix, superseded, down)
        except Superseded:
            return
        except Exception as exc:  # noqa: BLE001 - rebuild with the next chain
            if pg is not None:  # a group was built: its keys now name a peer that failed
                self._failed_chain = chain.number
            if not self._stop.is_set():
                log.info("relay: rid=%d hop from upstream ended (%s)", self._rid, error_text(exc)[:200])
                self._stop.wait(CHAIN_POLL_S)
        finally:
            deaf()
            down.close()
            close_group(pg, 0, self._backend)
            forget_hop(ctl, up_prefix, 1, spent=pg is not None, notes=(self._notes,))

    def _serve(self, ctl: Control, pg: PeerGroup, prefix: str, moved: Callable[[], bool], down: Downstream) -> None:
        hop = self._hop
        assert hop is not None
        chain_hop = ChainHop(hop)
        n = self._notes = 0
        while not self._stop.is_set():
            ctl.set_text(keys.ready(prefix, n), hop.ready_note())  # what a delta may be made against
            hop.expect([pg])
            while not hop.arrived():
                if down.missed and down.connected() and chain_hop.resend(down):
                    down.finish()
                if self._stop.wait(POLL_S) or moved():  # a new chain or a lost election ends this hop
                    return
            msg = chain_hop.receive(pg, down)
            n = self._notes = n + 1
            self._accept(ctl, hop, msg)
            down.finish()

    def _accept(self, ctl: Control, hop: HopReceiver, msg: Message) -> None:
        accepted, reason = hop.check(ctl, self._epoch, msg)
        draft, hop.draft = hop.draft, None
        if reason is not None:
            self._on_rejected(msg.version, reason)
        if not accepted:
            if draft is not None:
                draft.discard()
            return
        row = Receipt(msg.delta, msg.stats.wire_bytes, msg.stats.changed_share, msg.stats.decode_s)
        self._receipts.setdefault(msg.version, row)  # a resend after a chain change keeps the first receipt
        for old in sorted(self._receipts)[:-_RECEIPTS]:
            del self._receipts[old]
        ctl.put(keys.relay_received(self._epoch, self._rid), ReceiptsRecord(dict(self._receipts)))
        own = self._own
        version = msg.version
        newer = self.published_version is None or version > self.published_version
        if draft is not None:
            draft.commit(version)  # received straight into the host ring: published with no copy
        elif own is None or not newer:
            return
        # Every slot was held when the version came (a stalled reader, within its lease): it
        # was received into staging and is copied into a slot free now, or skipped here.
        elif own.write(version, entry_views(self.layout, hop.staging)) is None:
            log.warning("relay: version %d not published on this host: every slot of its ring is held", version)
            return
        if not newer:
            return  # a resend after a chain change: host-mates hold it already
        self.published_version = version
        self._on_published(version)

    def _published(self, version: int) -> None:
        """A version READ over NIXL was published in this host's ring (nixl/hop.py)."""
        if self.published_version is None or version > self.published_version:
            self.published_version = version
            self._on_published(version)

    def _stream(self) -> Stream:
        """This member's relay stream, as its hops are made with."""
        return Stream(number=self._epoch, backend=self._backend, addr=self._addr, timeout_s=self._timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        exits.left_behind(self._thread, self._timeout_s)  # maybe in a hop's receive: the exit waits for it
