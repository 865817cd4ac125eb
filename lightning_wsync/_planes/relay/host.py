"""A rollout host of the relay: leader election, the host's ring, and the receivers' data plane.

See :mod:`~lightning_wsync._planes.relay.head` for the chain; the leader's hops (receive,
rebuild, verify, forward) are in :mod:`~lightning_wsync._planes.relay.hop` and
:mod:`~lightning_wsync._planes.relay.down`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import torch

from lightning_wsync._control import keys
from lightning_wsync._control.host import pid_alive
from lightning_wsync._control.manifest import Manifest, entry_views
from lightning_wsync._control.records import LeaderRecord, Receipt, ReceiptsRecord, SenderRecord
from lightning_wsync._control.store import Control
from lightning_wsync._planes.base import Reject, SumsLookup
from lightning_wsync._planes.relay.down import Downstream
from lightning_wsync._planes.relay.head import (
    CHAIN_POLL_S,
    POLL_S,
    Chain,
    Superseded,
    error_text,
    join_hop,
    read_chain,
)
from lightning_wsync._planes.relay.hop import HopReceiver, Message
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync._planes.shm.segment import ShmReader, ShmSegment, remove_stale_segments, segment_name
from lightning_wsync._planes.shm.source import SharedMemorySource
from lightning_wsync._planes.wire import PeerGroup, shutdown_group
from lightning_wsync.errors import WeightSyncAuthError, WeightSyncError, WeightSyncRecordError

log = logging.getLogger(__name__)

_SEGMENT_POLL_S = 0.005  # a waiting host-mate reads the segment header this often (~0.5% of a core)
_RECEIPTS = 8  # versions a leader reports how it got (push reports read them)


class HostSegment:
    """The host's ring of verified versions, read as same-host receivers read the trainer's."""

    def __init__(self, epoch: int, layout: Manifest, ordered: list[torch.Tensor], name: str) -> None:
        self.epoch = epoch
        self.layout = layout
        self._ordered = ordered
        self._name = name
        self._source: SharedMemorySource | None = None
        self._segment: str | None = None
        self._lock = threading.Lock()

    def follow(self, segment: str | None) -> None:
        """Read from the ring ``segment`` from now on (the current leader's)."""
        with self._lock:
            if segment == self._segment and self._source is not None:
                return
            if self._source is not None:
                self._source.close()
                self._source = None
            self._segment = segment
            if segment is not None:
                try:
                    reader = ShmReader(segment, self.layout)
                except (OSError, ValueError, WeightSyncError) as exc:  # a new leader is creating it: retried
                    log.debug("host ring %s not readable yet: %s", segment, exc)
                    self._segment = None
                    return
                self._source = SharedMemorySource(self.epoch, self.layout, self._ordered, reader, self._name)

    def current(self) -> SharedMemorySource | None:
        return self._source

    def apply(self, held: int | None, reject: Reject) -> int | None:
        with self._lock:  # follow() cannot close the ring under a copy
            source = self._source
            return None if source is None else source.apply(held, None, reject)  # verified by the leader

    def pending_above(self, held: int | None) -> bool:
        with self._lock:
            return self._source is not None and self._source.pending_above(held)

    def close(self) -> None:
        self.follow(None)


class RelayMember:
    """A rollout receiver on a host other than the sender's: elects, leads, relays.

    One named thread: every ``CHAIN_POLL_S`` it reads the host's leader record, takes
    over when the leader is gone or silent, points the :class:`HostSegment` at the
    leader's segment, and while this receiver leads, runs the hop loop (receive from
    upstream, forward downstream, publish into the host segment).
    """

    def __init__(
        self, control: Control, layout: Manifest, segment: HostSegment, *, epoch: int, rid: int, host: str, job: str,
        backend: str, addr: str, timeout_s: float, heartbeat_timeout_s: float,
        on_published: Callable[[int], None], on_rejected: Callable[[int, str], None],
    ) -> None:  # fmt: skip
        self.layout = layout
        self.segment = segment
        self.published_version: int | None = None
        self._control = control
        self._epoch = epoch
        self._rid = rid
        self._host = host
        self._job = job
        self._backend = backend
        self._addr = addr
        self._timeout_s = timeout_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._on_published = on_published
        self._on_rejected = on_rejected
        self._own: SnapshotRing | None = None
        self._hop: HopReceiver | None = None  # while leading: staging, and the version it holds
        self._receipts: dict[int, Receipt] = {}
        self._leader_hb: tuple[int, int, float] | None = None  # (rid, hb, seen at)
        self._next_leader_check = 0.0  # when the leader's gone key and heartbeat are read next
        self._failed_gen: int | None = None  # the chain generation whose hop from upstream failed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"wsync-relay-r{rid}", daemon=True)
        self._thread.start()

    # -- election -----------------------------------------------------------------
    def _leader_gone(self, ctl: Control, record: LeaderRecord) -> str | None:
        rid, pid = record.rid, record.pid
        if rid == self._rid:
            return None
        if not pid_alive(pid):
            return f"leader rid={rid} (pid {pid}) is gone"
        seen = self._leader_hb
        now = time.monotonic()
        if seen is not None and seen[0] == rid and now < self._next_leader_check:
            return None
        # The leader's pid is looked at every CHAIN_POLL_S, its gone key and heartbeat every
        # heartbeat_timeout_s / 8: every receiver on every host runs this loop, and two store
        # requests each CHAIN_POLL_S were most of a host's steady load on the store.
        self._next_leader_check = now + max(CHAIN_POLL_S, self._heartbeat_timeout_s / 8)
        if ctl.has(keys.member_gone(rid)):
            return f"leader rid={rid} left"
        hb = ctl.add(keys.member_heartbeat(rid), 0)
        if seen is None or seen[0] != rid or seen[1] != hb:
            self._leader_hb = (rid, hb, now)
            return None
        if now - seen[2] > self._heartbeat_timeout_s:
            silent = now - seen[2]
            return f"leader rid={rid} silent for {silent:.1f} s (heartbeat_timeout_s={self._heartbeat_timeout_s})"
        return None

    def _elect(self, ctl: Control) -> LeaderRecord | None:
        key = keys.relay_leader(self._epoch, self._host)
        raw = ctl.get_text(key)
        record: LeaderRecord | None = None
        reason: str | None = "no leader"
        if raw is not None:
            try:
                record = ctl.decode(key, raw, LeaderRecord)
                reason = self._leader_gone(ctl, record)
            except (WeightSyncRecordError, WeightSyncAuthError) as exc:  # forged or garbled: replaced like a dead one
                reason = f"unreadable leader record ({exc})"
        if reason is None:
            return record
        term = 0 if record is None else record.term + 1
        mine = LeaderRecord(self._rid, os.getpid(), term, segment_name(f"{self._job}-relay", self._epoch))
        sealed = ctl.seal(key, mine.encode())
        now = ctl.compare_set(key, raw or "", sealed)
        if now.decode("utf-8", "replace") == sealed:
            log.info("relay: receiver rid=%d leads host %s (term %d; %s)", self._rid, self._host, term, reason)
            return mine
        return ctl.decode(key, now, LeaderRecord)

    def _run(self) -> None:
        ctl = self._control.clone()
        while not self._stop.is_set():
            try:
                record = self._elect(ctl)
                leading = record is not None and record.rid == self._rid
                if leading and self._own is None:
                    assert record is not None
                    remove_stale_segments()  # a SIGKILLed predecessor's ring, among others
                    segment = ShmSegment(record.shm, self.layout.total_bytes, create=True, slots=2)
                    self._own = SnapshotRing(self.layout, segment=segment, device=torch.device("cpu"), slots=2,
                                             lease_s=min(self._timeout_s, self._heartbeat_timeout_s))  # fmt: skip
                    self._hop = HopReceiver(self.layout, self._own)
                self.segment.follow(None if record is None else record.shm)
                if leading:
                    self._lead(ctl)  # returns when the chain changes, a hop fails, or leadership is lost
                else:
                    self._step_down()
                    self._stop.wait(CHAIN_POLL_S)
            except Exception as exc:  # noqa: BLE001 - the relay must outlive any one bad step
                if not self._stop.is_set():
                    log.warning("relay: receiver rid=%d step failed: %s", self._rid, error_text(exc))
                    self._stop.wait(CHAIN_POLL_S)
        self._step_down()

    def _step_down(self) -> None:
        if self._own is not None:
            self.segment.follow(None)
            self._own.close()
            if self._own.segment is not None:
                self._own.segment.close()
            self._own = None
            self._hop = None

    def _still_leader(self, ctl: Control) -> bool:
        try:
            record = ctl.get_record(keys.relay_leader(self._epoch, self._host), LeaderRecord)
        except (WeightSyncRecordError, WeightSyncAuthError):
            return False
        return record is not None and record.rid == self._rid

    # -- leading ------------------------------------------------------------------
    def _lead(self, ctl: Control) -> None:
        chain = read_chain(ctl, self._epoch)
        if chain is None or self._rid not in chain.rids or chain.gen == self._failed_gen:
            # A hop whose group was built and then failed cannot be joined again (its store
            # keys name the old peer, which may be stalled: joining would block for timeout_s).
            # The side that sent to it marked the failure, so the sender re-forms the chain
            # under a new generation. A hop whose peer never came is simply joined again.
            self._stop.wait(CHAIN_POLL_S)
            return
        pos = chain.rids.index(self._rid)
        up_prefix = keys.relay_hop_prefix(self._epoch, chain.gen, self._rid)
        down = Downstream(ctl, self._epoch, chain, pos, self.layout, self._backend, self._addr, self._timeout_s)
        pg: PeerGroup | None = None

        def superseded() -> bool:
            current = read_chain(ctl, self._epoch)
            return self._stop.is_set() or current is None or current.gen != chain.gen or not self._still_leader(ctl)

        try:
            pg = join_hop(ctl, up_prefix, 1, self._backend, self._addr, self._timeout_s, superseded)
            self._serve(ctl, pg, up_prefix, chain, down)
        except Superseded:
            return
        except Exception as exc:  # noqa: BLE001 - rebuild with the next chain
            if pg is not None:  # a group was built: its keys now name a peer that failed
                self._failed_gen = chain.gen
            if not self._stop.is_set():
                log.info("relay: rid=%d hop from upstream ended (%s)", self._rid, error_text(exc)[:200])
                self._stop.wait(CHAIN_POLL_S)
        finally:
            down.close()
            shutdown_group(pg)

    def _serve(self, ctl: Control, pg: PeerGroup, prefix: str, chain: Chain, down: Downstream) -> None:
        hop = self._hop
        assert hop is not None
        n = 0
        next_check = 0.0
        while not self._stop.is_set():
            ctl.set_text(keys.ready(prefix, n), hop.ready_note())  # what a delta may be made against
            hop.expect(pg)
            while not hop.arrived():
                if down.missed and down.connected() and hop.resend(down):
                    down.finish()
                if self._stop.wait(POLL_S):
                    return
                now = time.monotonic()
                if now >= next_check:  # a new chain or a lost election ends this hop
                    next_check = now + CHAIN_POLL_S
                    current = read_chain(ctl, self._epoch)
                    if current is None or current.gen != chain.gen or not self._still_leader(ctl):
                        return
            msg = hop.receive(pg, down)
            n += 1
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

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)


class RelaySource:
    """A receiver's data plane on a relay host (a ``ReceiveSource``): the host's ring, fed by its leader."""

    def __init__(self, epoch: int, segment: HostSegment, member: RelayMember) -> None:
        self.epoch = epoch
        self.segment = segment
        self.member = member

    def apply(self, held: int | None, sums: SumsLookup | None, reject: Reject) -> int | None:
        return self.segment.apply(held, reject)

    def pending_above(self, held: int | None) -> bool:
        return self.segment.pending_above(held)

    def wait_change(self, until: float, give_up: Callable[[], bool]) -> bool:
        source = self.segment.current()
        if source is None:
            return False
        source._poll_s = _SEGMENT_POLL_S  # many waiting host-mates: a lighter watch of the ring header
        return source.wait_change(until, lambda: give_up() or self.segment.current() is not source)

    def describe(self) -> str:
        return "relay across hosts (host ring)"

    def close(self) -> None:
        self.member.close()
        self.segment.close()


def open_relay_source(
    control: Control, layout: Manifest, ordered: list[torch.Tensor], record: SenderRecord, *, epoch: int,
    rid: int, host: str, job: str, name: str, addr: str, timeout_s: float,
    on_published: Callable[[int], None], on_rejected: Callable[[int, str], None],
) -> RelaySource:  # fmt: skip
    """The data plane of a receiver on a host other than the sender's, when the sender relays."""
    segment = HostSegment(epoch, layout, ordered, name)
    member = RelayMember(
        control, layout, segment, epoch=epoch, rid=rid, host=host, job=job, backend=record.backend,
        addr=addr, timeout_s=record.timeout_s,  # the sender's: it bounds every hop, whatever this receiver's
        heartbeat_timeout_s=record.heartbeat_timeout_s,
        on_published=on_published, on_rejected=on_rejected,
    )  # fmt: skip
    return RelaySource(epoch, segment, member)
