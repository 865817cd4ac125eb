"""Across hosts, one network copy per host: host leaders relay each version down a chain.

Longer than 300 lines: some sixty of them are this description of the relay (leaders,
chain, checks, failures), kept beside the head that feeds the chain's first leader.

::

    trainer ──► leader of host 1 ──► leader of host 2 ──► ... ──► leader of host H
                  │ verified copy into the host segment             │
                  ▼                                                 ▼
              receivers on host 1 (shared memory)              receivers on host H

- **Leaders.** On each host the receivers elect one leader through the store
  (``compare_set`` on ``relay/<epoch>/leader/<host>``, keyed by :func:`host_id`). A
  leader whose process is gone (checked by PID only from the leader's own PID namespace)
  or whose heartbeat has not moved for the sender's ``heartbeat_timeout_s`` is replaced by
  a host-mate; no process restarts. A leader that cannot create the host segment resigns;
  it, and a host-mate that cannot open the leader's segment (another /dev/shm or user),
  receive over the network from the sender instead (:mod:`~lightning_wsync._planes.relay.leader.member`).
  Only the leader receives from the network; it verifies each version into a private
  staging buffer, then writes it into the host's shared-memory segment under the same
  sequence-counter rules as the trainer's snapshot, and every receiver on the host (the
  leader included) applies from there exactly as same-host receivers of the trainer do.
- **Chain.** The sender orders the live leaders into a chain (``relay/<epoch>/chain``:
  a generation and a list of receiver ids; hosts that join are appended) and sends each
  version once, to the first. Every leader forwards chunk k downstream as soon as it has
  it, while chunk k+1 arrives: a version crosses H hosts in about one wire time plus one
  chunk time per hop. Each hop is its own two-rank gloo group under
  ``relay/<epoch>/pg/<gen>/<rid>/``, so a failed hop fails only itself.
- **Checks at every hop.** Each leader hashes every bucket as it arrives (or as it is
  rebuilt from a delta: the checksums are always the full version's) and accepts a
  version only when the trailer's snapshot sequence says the trainer's snapshot was not
  overwritten mid-send, its MAC (the job secret, over epoch, version, snapshot sequence and
  checksums) verifies, and every checksum matches. A leader forwards the trailer as it
  got it, so the hosts behind check the trainer's signature, not their upstream's word.
- **Deltas on every hop.** Before each message a downstream side writes what it holds
  (``ready/<n>`` under the hop's prefix: version and a digest of its checksums, as on
  direct links). The head sends a delta against that version when its ring still has
  it (``delta=``, as for direct links), else the full version. A leader rebuilds a delta
  in its staging buffer, which holds the last version it accepted, and forwards the
  records as they arrive when the next leader holds the same base; otherwise it sends
  the next leader the rebuilt buckets, one after another, as a full version. So a host
  that missed or rejected a version, a new leader after a failover and a late host get
  one full version, then deltas again. Module :mod:`relay_host` holds the leaders' side.
- **Failure.** A hop that dies fails at once; one that stalls fails at the group
  timeout (``timeout_s``). The upstream side marks the downstream leader broken
  (``relay/<epoch>/broken/<rid>``); the sender drops it from the chain (also when its
  heartbeat stops) and publishes a new generation; the sending side of every hop ends a send
  under way (its peer may have left; a send into a group nobody serves blocks for ``timeout_s``;
  the head's sends run in a thread of their own, which it leaves behind, as gloo wakes a send
  part-written into a leader that left for nothing: :func:`~lightning_wsync._planes.relay.hops.send_apart`;
  but not the head's send to a first leader that stays first, which reads that version to its end),
  every leader rebuilds its hops and the head sends the newest version again. A dropped leader is
  re-admitted after ``heartbeat_timeout_s`` once its heartbeat has moved since the drop. Each side
  deletes a hop's keys when it leaves it; the sender deletes what dead leaders and replaced chains
  left after ``timeout_s + heartbeat_timeout_s``.

Why a chain, and when two trees: a chain keeps every link at one copy per version (the trainer's
and each host's egress stay one model at any host count) and costs a chunk time plus a hop latency
per host; two complementary binary trees (``cross_host="tree"``, :mod:`relay.plan`) keep every link
at one model and cross log2(H) levels, with deltas on every edge (:mod:`relay.treedelta`);
``cross_host="relay"`` picks by the push-time model on a version's wire size (full, or the last delta's).

Shared by both ends of a hop: ``hops.py``; the leader side: ``leader/member.py``; the trees' head: ``head/treefeed.py``.

Longer than 300 lines: the head's chain upkeep and its choice of shape (chain or trees, full or
delta) read the same leader records and are kept together.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

from lightning_wsync._control import keys
from lightning_wsync._control.records import ChainRecord, LeaderRecord, ReceiptsRecord
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import Timing
from lightning_wsync._planes.delta.encode import AutoPolicy, DeltaStream, DeltaStreams, delta_base
from lightning_wsync._planes.delta.wire import send_delta
from lightning_wsync._planes.relay import exits
from lightning_wsync._planes.relay.head.treefeed import TreeFeed
from lightning_wsync._planes.relay.hops import (
    CHAIN_POLL_S,
    RELAY_RID,
    Chain,
    Stream,
    Superseded,
    chunks,
    error_text,
    hop_header,
    join_hop,
    mark_broken,
    next_lease,
    ring_bell,
    send_apart,
    wait_ready,
)
from lightning_wsync._planes.relay.plan import choose_tree
from lightning_wsync._planes.relay.tidy import RelaySweeper, forget_hop
from lightning_wsync._planes.shm.ring import Lease, SnapshotRing
from lightning_wsync._planes.wire import DELTA, FULL, Interruptible, PeerGroup, close_group, signed_trailer
from lightning_wsync.errors import WeightSyncAuthError, WeightSyncError, WeightSyncRecordError

log = logging.getLogger(__name__)


class HopReceipt(NamedTuple):
    """How a leader got one version: the push report's delta figures for its host."""

    delta: bool
    wire_bytes: int
    changed_share: float
    decode_s: float


class RelayHead:
    """The sender's side: keeps the chain on the store and feeds its first leader.

    ``deltas`` and ``policy`` are the sender's, shared with its direct links: a version
    is encoded once per base for all of them.
    """

    def __init__(
        self, control: Control, ring: SnapshotRing, stream: Stream, *, timing: Timing,
        deltas: DeltaStreams | None = None, policy: AutoPolicy | None = None,
        topology: str = "chain",
    ) -> None:  # fmt: skip
        self.chain = Chain(0, ())
        self._topology = topology  # chain | tree | relay (the push-time model picks by host count)
        self.leaders: dict[int, str] = {}  # rid -> host, as last given to update_chain
        self._control = control
        self._ring = ring
        self._stream = stream
        self._epoch = epoch = stream.number
        self._backend = stream.backend
        self._addr = stream.addr
        self._timeout_s = stream.timeout_s
        self._heartbeat_timeout_s = timing.heartbeat_timeout_s
        self._deltas = deltas
        self._policy = policy or AutoPolicy("off")
        # rid -> (until (time.monotonic()), its heartbeat count when dropped): re-admitted once both
        # the time has passed and the count has moved since (see update_chain).
        self._excluded: dict[int, tuple[float, int | None]] = {}
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._pieces = chunks(ring.layout)
        self._bucket_bytes = ring.layout.total_bytes / max(1, len(ring.layout.buckets))
        self._sweeper = RelaySweeper(epoch, linger_s=timing.relay_linger_s)
        self._notes = 0  # ready notes taken on the current hop to the first leader
        self._hop: tuple[int, Interruptible] | None = None  # (chain number, hop to its first leader) being fed
        self._thread = threading.Thread(target=self._run, name=f"wsync-relay-head-e{epoch}", daemon=True)
        self._thread.start()

    def update_chain(self, leaders: dict[int, str], *, look: bool = True) -> None:
        """Re-form the chain from the live leaders (rid -> host), reading their broken keys if ``look``."""
        ctl, now = self._control, time.monotonic()
        self.leaders = dict(leaders)
        for rid in leaders if look else ():
            if rid not in self._excluded and ctl.has(keys.relay_broken(self._epoch, rid)):
                ctl.delete(keys.relay_broken(self._epoch, rid))
                self._excluded[rid] = (now + self._heartbeat_timeout_s, self._beats(ctl, rid))
                log.warning("relay: leader rid=%d dropped from the chain (a hop to it failed)", rid)
        self._excluded = {r: e for r, e in self._excluded.items()
                          if r in leaders and not self._readmit(ctl, r, *e, now)}  # fmt: skip
        wanted = {rid for rid in leaders if rid not in self._excluded}
        kept = [r for r in self.chain.rids if r in wanted]
        rids = tuple(kept + sorted(wanted - set(kept), key=lambda r: leaders[r]))
        self._sweeper.sweep(ctl, leaders)
        share = 1.0 if self._deltas is None else self._policy.wire_share()  # "relay": the model picks
        current = self.chain.tree if self.chain.number and len(rids) == len(self.chain.rids) else None
        tree = self._topology == "tree" or self._topology == "relay" and choose_tree(
            len(rids), wire_share=share, bucket_bytes=self._bucket_bytes, current=current)
        if rids == self.chain.rids and tree == self.chain.tree:
            return
        if self.chain.number:
            self._sweeper.replaced(self.chain.number, self.chain.rids, self.chain.tree)
        old, self.chain = self.chain, Chain(self.chain.number + 1, rids, tree)
        ctl.put(keys.relay_chain(self._epoch), ChainRecord(self.chain.number, tuple(rids), tree))
        for rid in sorted({*old.rids, *rids, *leaders}):  # after the record: the woken read the new one
            ring_bell(ctl, self._epoch, rid)
        log.info("relay %s %d: %s", "trees" if tree else "chain", self.chain.number, list(rids))
        self._changed.set()
        # A send into the old chain's first leader waiting for its receive ends now (one already
        # part-written: at timeout_s): a group nobody serves would block it for timeout_s. Not when
        # that leader is still first: it reads the version to its end before it looks at the chain,
        # and a send ended mid-version would leave its receive partly read, waking only at timeout_s.
        if (hop := self._hop) is not None and hop[0] != self.chain.number and old.rids[:1] != rids[:1]:
            hop[1].interrupt()

    def _readmit(self, ctl: Control, rid: int, until: float, beats: int | None, now: float) -> bool:
        """Whether dropped leader ``rid`` is back: ``heartbeat_timeout_s`` has passed since the drop
        and its heartbeat has moved since. The time alone is not enough: the membership counts a
        leader dead only ``heartbeat_timeout_s`` after it *saw* its last beat, which may be after the
        hop to it failed, and a SIGKILLed leader was re-admitted in that gap (2.0 s after its drop, then
        dropped again 0.2 s later: two re-forms, the newest version sent again, and a host behind
        it that got a version in full from a parent that already held it; seen 2026-11-29)."""
        if now < until:
            return False
        moved = self._beats(ctl, rid)
        return moved is not None and moved != beats

    def _beats(self, ctl: Control, rid: int) -> int | None:
        """Leader ``rid``'s heartbeat count (``member/<rid>/hb``); None where it is unreadable."""
        try:
            return ctl.add(keys.member_heartbeat(rid), 0)
        except WeightSyncError as exc:  # garbled by a store writer: no beat seen (its owner rewrites it)
            log.debug("relay: leader rid=%d's heartbeat: %s", rid, exc)
            return None

    def receipts(self, ctl: Control, version: int) -> dict[str, HopReceipt]:
        """host -> how its leader got ``version`` (hosts whose leader has not reported it are left out)."""
        out: dict[str, HopReceipt] = {}
        for rid, host in self.leaders.items():
            try:
                value = ctl.get_record(keys.relay_received(self._epoch, rid), ReceiptsRecord)
            except (WeightSyncRecordError, WeightSyncAuthError) as exc:  # that host's figures are left out
                log.debug("relay: %s", exc)
                continue
            row = None if value is None else value.receipts.get(version)
            if row is not None:
                out[host] = HopReceipt(row.delta, row.wire_bytes, row.changed_share, row.decode_s)
        return out

    def _run(self) -> None:
        if self._stream.nixl:  # the first leader READs the trainer's ring itself (nixl/hop.py)
            return
        ctl = self._control.clone()
        while not self._stop.is_set():
            self._changed.clear()
            chain = self.chain
            if not chain.rids:
                self._changed.wait(CHAIN_POLL_S)
                continue
            if chain.tree:
                feed = TreeFeed(ctl, self._ring, chain, self._stream, superseded=self._superseded, deltas=self._deltas,
                                policy=self._policy)  # fmt: skip
                if feed.run():
                    self._changed.wait()  # the failed generation's hops cannot be joined again
                continue
            first = chain.rids[0]
            prefix = keys.relay_hop_prefix(self._epoch, chain.number, first)
            pg: PeerGroup | None = None
            self._notes = 0
            try:
                pg = Interruptible(join_hop(ctl, prefix, 0, self._backend, self._addr, self._timeout_s,
                                            self._superseded), self._backend)  # fmt: skip
                self._hop = (chain.number, pg)
                self._feed(pg, ctl, chain)
            except Superseded:
                continue
            except Exception as exc:  # noqa: BLE001 - this hop only; the chain is re-formed
                if not self._superseded():
                    log.warning("relay: hop to leader rid=%d failed: %s", first, error_text(exc))
                    mark_broken(ctl, self._epoch, first)
                    self._changed.wait()  # the failed generation's hop cannot be joined again (close() sets it too)
            finally:
                self._hop = None
                close_group(pg, 1, self._backend)
                forget_hop(ctl, prefix, 0, spent=pg is not None, notes=(self._notes,))

    def _superseded(self) -> bool:
        return self._stop.is_set() or self._changed.is_set()

    def _feed(self, pg: PeerGroup, ctl: Control, chain: Chain) -> None:
        ring = self._ring
        if self._deltas is not None:
            self._deltas.prepare()
        first = chain.rids[0]
        prefix = keys.relay_hop_prefix(self._epoch, chain.number, first)
        sent: int | None = None
        n = 0
        while not self._superseded():
            held = wait_ready(ctl, keys.ready(prefix, n), ring, sent, self._timeout_s, self._superseded,
                              f"leader rid={first}")  # fmt: skip
            if (lease := next_lease(ring, sent, self._superseded)) is None:
                return
            try:
                delta = delta_base(ring, self._deltas, self._policy, held, lease, f"relay leader rid={first}")
            except BaseException:
                lease.release()
                raise
            self._send_apart(pg, ctl, lease, delta, first)
            sent, n = lease.ref.version, n + 1
            self._notes = n

    def _send_apart(
        self, pg: PeerGroup, ctl: Control, lease: Lease, delta: tuple[DeltaStream, Lease] | None, first: int
    ) -> None:
        """:meth:`_send` from a thread left behind (holding its slots) if the chain changes first,
        as the trees' feed does (:func:`~lightning_wsync._planes.relay.hops.send_apart`); releases the leases.

        A chain that changes with ``first`` still its first leader (a leader further down died) does
        not end the send: ``first`` reads the version to its end either way, then moves on, and a
        send left behind mid-version would hold its receive until ``timeout_s`` (a flake hunt,
        2026-11-29: versions stalled 10 s after a middle leader's death).

        Raises:
            Superseded: the chain changed before the version was sent, and ``first`` leads it no more.
        """

        def first_moved() -> bool:
            return self._stop.is_set() or self.chain.rids[:1] != (first,)

        def release() -> None:
            if delta is not None:
                delta[1].release()
            lease.release()

        send_apart(lambda: self._send(pg, ctl, lease, delta), release, first_moved,
                   f"wsync-relay-head-send-v{lease.ref.version}", self._timeout_s)  # fmt: skip

    def _send(self, pg: PeerGroup, ctl: Control, lease: Lease, delta: tuple[DeltaStream, Lease] | None) -> None:
        ring, layout = self._ring, self._ring.layout
        buffer, (_, seq, version) = lease.buffer, lease.ref
        pg.send([hop_header(version, seq, layout, FULL if delta is None else DELTA)], 1, 0).wait()
        if delta is None:
            works = [pg.send([buffer[a:b]], 1, 0) for a, b, _ in self._pieces]
            sums = ring.checksums(lease)  # while gloo streams the chunks; shared with the star links
            for work in works:
                work.wait()
                lease.touch()
        else:
            stream, base = delta
            sums = send_delta(pg, ring, lease, stream, base, f"relay-e{self._epoch}")
            self._policy.observe(version, stream.stats())
        trailer = signed_trailer(ctl, self._epoch, RELAY_RID, version, seq, sums, intact=lease.intact(),
                                 buckets=len(layout.buckets))  # fmt: skip
        pg.send([trailer], 1, 0).wait()
        log.debug("relay: version %d sent %s", version, "in full" if delta is None else "as a delta")

    def _ring_bells(self, rung: set[int]) -> set[int]:
        """Ring each leader of the chain or known to this head not in ``rung``; all rung so far.
        A bell the store refuses is logged and left out of the answer (close's second round tries it again)."""
        for rid in sorted({*self.chain.rids, *self.leaders} - rung):
            try:
                ring_bell(self._control, self._epoch, rid)
            except WeightSyncError as exc:
                log.debug("relay: bell of leader %d unrung: %s", rid, exc)
                continue
            rung.add(rid)
        return rung

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop feeding, ring every leader known (after the sender's close record and its ``news``
        bump: their watchers find the close at once) and delete the chain's keys. The bells ring
        before the feed thread is joined (a hop it is in may hold it seconds), and again for any
        leader it took on meanwhile."""
        self._stop.set()
        self._changed.set()
        rung = self._ring_bells(set())
        if (hop := self._hop) is not None:
            hop[1].interrupt()
        self._thread.join(timeout=timeout_s)
        exits.left_behind(self._thread, self._timeout_s)  # maybe joining a hop (gloo): the exit waits for it
        try:
            self._ring_bells(rung)
            self._sweeper.close(self._control, self.chain.number, self.chain.rids, self.chain.tree)
        except WeightSyncError as exc:  # the store went first: nothing left to keep bounded
            log.debug("relay: keys of epoch %d left on the store: %s", self._epoch, exc)


def leader_record(ctl: Control, epoch: int, host: str) -> LeaderRecord | None:
    """The host's leader, or None while it has none (or an unreadable record, which its host-mates replace)."""
    try:
        return ctl.get_record(keys.relay_leader(epoch, host), LeaderRecord)
    except (WeightSyncRecordError, WeightSyncAuthError) as exc:
        log.debug("relay: %s", exc)
        return None
