"""Across hosts, one network copy per host: host leaders relay each version down a chain.

::

    trainer ──► leader of host 1 ──► leader of host 2 ──► ... ──► leader of host H
                  │ verified copy into the host segment             │
                  ▼                                                 ▼
              receivers on host 1 (shared memory)              receivers on host H

- **Leaders.** On each host the receivers elect one leader through the store
  (``compare_set`` on ``relay/<epoch>/leader/<host>``, keyed by :func:`host_id`). A
  leader whose process is gone (same host: checked by PID) or whose heartbeat has not
  moved for the sender's ``heartbeat_timeout_s`` is replaced by a host-mate; no process
  restarts. Only the leader receives from the network; it verifies each version into a
  private staging buffer, then writes it into the host's shared-memory segment under
  the same sequence-counter rules as the trainer's snapshot, and every receiver on the
  host (the leader included) applies from there exactly as same-host receivers of the
  trainer do.
- **Chain.** The sender orders the live leaders into a chain (``relay/<epoch>/chain``:
  a generation and a list of receiver ids; hosts that join are appended) and sends each
  version once, to the first. Every leader forwards chunk k downstream as soon as it has
  it, while chunk k+1 arrives: a version crosses H hosts in about one wire time plus one
  chunk time per hop. Each hop is its own two-rank gloo group under
  ``relay/<epoch>/pg/<gen>/<rid>/``, so a failed hop fails only itself.
- **Checks at every hop.** Each leader hashes every bucket as it arrives and accepts a
  version only when the trailer's snapshot sequence says the trainer's snapshot was not
  overwritten mid-send, its MAC (the job secret, over epoch, version, snapshot sequence and
  checksums) verifies, and every checksum matches. A leader forwards the trailer as it
  got it, so the hosts behind check the trainer's signature, not their upstream's word.
- **Failure.** A hop that dies fails at once; one that stalls fails at the group
  timeout (``timeout_s``). The upstream side marks the downstream leader broken
  (``relay/<epoch>/broken/<rid>``); the sender drops it from the chain (also when its
  heartbeat stops) and publishes a new generation; every leader rebuilds its hops and
  the head sends the newest version again. A dropped leader is re-admitted after
  ``heartbeat_timeout_s`` if still live.

Why a chain and not a tree: measured on simulated hosts (see the README), a chain keeps
every link at one copy per version, so the trainer's egress and each host's egress stay
at one model whatever the host count; a tree with fan-out f multiplies each relay's
egress by f, which on equal links costs f wire times, far more than the chain's extra
chunk time per hop at these host counts.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash

from lightning_wsync._control import Control, pid_alive
from lightning_wsync._manifest import Manifest, entry_views
from lightning_wsync._source import Reject, SharedMemorySource, SumsLookup
from lightning_wsync.errors import WeightSyncError
from lightning_wsync.transport.net import (
    MAC_WORDS,
    PeerGroup,
    make_group,
    shutdown_group,
    to_int64,
    trailer_mac,
)
from lightning_wsync.transport.ring import SnapshotRing
from lightning_wsync.transport.shm import (
    ShmReader,
    ShmSegment,
    remove_stale_segments,
    segment_name,
)

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 19  # pipelining unit between hops (a bucket is hashed once all its chunks are in)
_POLL_S = 0.002
_CHAIN_POLL_S = 0.05
_SEGMENT_POLL_S = 0.005  # a waiting host-mate reads the segment header this often (~0.5% of a core)
_DOWNSTREAM_CONNECT_S = 2.0  # a version arriving before the next hop is connected waits this long for it
_RELAY_RID = -1  # trailer MACs name no receiver: the same trailer is forwarded down the chain


def host_key(host: str) -> str:
    return hashlib.sha256(host.encode()).hexdigest()[:16]


def leader_key(epoch: int, host: str) -> str:
    return f"relay/{epoch}/leader/{host_key(host)}"


def chain_key(epoch: int) -> str:
    return f"relay/{epoch}/chain"


def broken_key(epoch: int, rid: int) -> str:
    return f"relay/{epoch}/broken/{rid}"


def hop_prefix(epoch: int, gen: int, rid: int) -> str:
    return f"relay/{epoch}/pg/{gen}/{rid}/"


def chunks(layout: Manifest) -> list[tuple[int, int, int]]:
    """``(start, end, bucket)`` pieces of at most CHUNK_BYTES, never straddling a bucket."""
    out = []
    for i, (a, b) in enumerate(layout.buckets):
        for start in range(a, b, CHUNK_BYTES):
            out.append((start, min(b, start + CHUNK_BYTES), i))
    return out


@dataclass(frozen=True)
class Chain:
    gen: int
    rids: tuple[int, ...]


def read_chain(ctl: Control, epoch: int) -> Chain | None:
    value = ctl.get_json(chain_key(epoch))
    return None if value is None else Chain(int(value["gen"]), tuple(int(r) for r in value["rids"]))


class _Superseded(Exception):
    """The chain changed (or this side stopped) before the hop's peer showed up."""


def _join_hop(
    ctl: Control, prefix: str, rank: int, backend: str, addr: str, timeout_s: float, abandon: Callable[[], bool]
) -> PeerGroup:
    """Build a hop's group once its peer is known to be joining it too.

    Both sides first mark themselves under ``prefix``; the group is built only once the
    other's mark is there, so a side whose peer has moved on to a newer chain leaves at
    the next check of ``abandon()`` instead of blocking in the group's set-up for timeout_s.
    """
    ctl.set_text(prefix + f"joined/{rank}", "1")
    peer = prefix + f"joined/{1 - rank}"
    deadline = time.monotonic() + timeout_s
    next_check = 0.0
    while not ctl.has(peer):
        now = time.monotonic()
        if now >= next_check:
            if abandon():
                raise _Superseded(prefix)
            next_check = now + _CHAIN_POLL_S
        if now > deadline:
            raise TimeoutError(f"hop {prefix!r}: no peer within timeout_s={timeout_s}")
        time.sleep(_POLL_S)
    return make_group(backend, ctl.prefix_store(prefix), rank, addr, timeout_s)


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# -- the sender's side -----------------------------------------------------------------
class RelayHead:
    """The sender's side: keeps the chain on the store and feeds its first leader."""

    def __init__(
        self, control: Control, ring: SnapshotRing, *, epoch: int, backend: str, addr: str, timeout_s: float,
        heartbeat_timeout_s: float,
    ) -> None:  # fmt: skip
        self.chain = Chain(0, ())
        self._control = control
        self._ring = ring
        self._epoch = epoch
        self._backend = backend
        self._addr = addr
        self._timeout_s = timeout_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._excluded: dict[int, float] = {}  # rid -> until (time.monotonic())
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._pieces = chunks(ring.layout)
        self._thread = threading.Thread(target=self._run, name=f"wsync-relay-head-e{epoch}", daemon=True)
        self._thread.start()

    def update_chain(self, leaders: dict[int, str]) -> None:
        """Re-form the chain from the live leaders (rid -> host); called by the sender's background step."""
        ctl, now = self._control, time.monotonic()
        for rid in leaders:
            if rid not in self._excluded and ctl.has(broken_key(self._epoch, rid)):
                ctl.delete(broken_key(self._epoch, rid))
                self._excluded[rid] = now + self._heartbeat_timeout_s
                log.warning("relay: leader rid=%d dropped from the chain (a hop to it failed)", rid)
        self._excluded = {r: t for r, t in self._excluded.items() if t > now}
        wanted = {rid for rid in leaders if rid not in self._excluded}
        kept = [r for r in self.chain.rids if r in wanted]
        rids = tuple(kept + sorted(wanted - set(kept), key=lambda r: leaders[r]))
        if rids == self.chain.rids:
            return
        self.chain = Chain(self.chain.gen + 1, rids)
        ctl.set_json(chain_key(self._epoch), {"gen": self.chain.gen, "rids": list(rids)})
        log.info("relay chain gen %d: %s", self.chain.gen, list(rids))
        self._changed.set()

    def _run(self) -> None:
        ctl = self._control.clone()
        while not self._stop.is_set():
            self._changed.clear()
            chain = self.chain
            if not chain.rids:
                self._changed.wait(_CHAIN_POLL_S)
                continue
            first = chain.rids[0]
            pg: PeerGroup | None = None
            try:
                pg = _join_hop(ctl, hop_prefix(self._epoch, chain.gen, first), 0, self._backend, self._addr,
                               self._timeout_s, lambda: self._stop.is_set() or self._changed.is_set())  # fmt: skip
                self._feed(pg, ctl, chain)
            except _Superseded:
                continue
            except Exception as exc:  # noqa: BLE001 - this hop only; the chain is re-formed
                if not self._stop.is_set() and not self._changed.is_set():
                    log.warning("relay: hop to leader rid=%d failed: %s", first, _error_text(exc))
                    ctl.set_text(broken_key(self._epoch, first), "1")
                    while not self._stop.is_set() and not self._changed.wait(_CHAIN_POLL_S):
                        pass  # the same generation's hop cannot be joined again: wait for the re-formed chain
            finally:
                shutdown_group(pg)

    def _feed(self, pg: PeerGroup, ctl: Control, chain: Chain) -> None:
        ring, layout = self._ring, self._ring.layout
        prefix = hop_prefix(self._epoch, chain.gen, chain.rids[0])
        sent: int | None = None
        n = 0
        while not self._stop.is_set() and not self._changed.is_set():
            lease = ring.acquire_newer(sent, 0.05)  # the slot is not rewritten while this send holds it
            if lease is None:
                continue
            try:
                buffer, (_, seq, version) = lease.buffer, lease.ref
                header = torch.tensor([version, seq, layout.total_bytes, len(self._pieces)], dtype=torch.int64)
                ctl.set_text(prefix + f"ann/{n}", "1")
                pg.send([header], 1, 0).wait()
                works = [pg.send([buffer[a:b]], 1, 0) for a, b, _ in self._pieces]
                sums = ring.checksums(lease)  # while gloo streams the chunks; shared with the star links
                for work in works:
                    work.wait()
                    lease.touch()
                intact = sums is not None and lease.intact()
                words = [to_int64(x) for x in (sums or [0] * len(layout.buckets))]
                mac = trailer_mac(ctl, self._epoch, _RELAY_RID, version, seq, words)
                pg.send([torch.tensor([seq if intact else -1] + words + mac, dtype=torch.int64)], 1, 0).wait()
                sent, n = version, n + 1
            finally:
                lease.release()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._changed.set()
        self._thread.join(timeout=timeout_s)


# -- a rollout host's side --------------------------------------------------------------
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

    One named thread: every ``_CHAIN_POLL_S`` it reads the host's leader record, takes
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
        self.is_leader = False
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
        self._leader_hb: tuple[int, int, float] | None = None  # (rid, hb, seen at)
        self._failed_gen: int | None = None  # the chain generation whose hop from upstream failed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"wsync-relay-r{rid}", daemon=True)
        self._thread.start()

    # -- election -----------------------------------------------------------------
    def _leader_gone(self, ctl: Control, record: dict[str, object]) -> str | None:
        rid, pid = int(str(record["rid"])), int(str(record["pid"]))
        if rid == self._rid:
            return None
        if not pid_alive(pid):
            return f"leader rid={rid} (pid {pid}) is gone"
        if ctl.has(f"member/{rid}/gone"):
            return f"leader rid={rid} left"
        hb, now = ctl.add(f"member/{rid}/hb", 0), time.monotonic()
        seen = self._leader_hb
        if seen is None or seen[0] != rid or seen[1] != hb:
            self._leader_hb = (rid, hb, now)
            return None
        if now - seen[2] > self._heartbeat_timeout_s:
            silent = now - seen[2]
            return f"leader rid={rid} silent for {silent:.1f} s (heartbeat_timeout_s={self._heartbeat_timeout_s})"
        return None

    def _elect(self, ctl: Control) -> dict[str, object] | None:
        key = leader_key(self._epoch, self._host)
        raw = ctl.get_text(key)
        record = None if raw is None else ctl.open(key, raw)
        reason = "no leader" if record is None else self._leader_gone(ctl, record)
        if reason is None:
            return record
        term = 0 if record is None else int(record["term"]) + 1
        name = segment_name(f"{self._job}-relay", self._epoch)
        mine = {"rid": self._rid, "pid": os.getpid(), "term": term, "shm": name}
        sealed = ctl.seal(key, mine)
        now = ctl.store.compare_set(key, raw or "", sealed)
        if bytes(now).decode() == sealed:
            log.info("relay: receiver rid=%d leads host %s (term %d; %s)", self._rid, self._host, term, reason)
            return mine
        return dict(ctl.open(key, bytes(now)))

    def _run(self) -> None:
        ctl = self._control.clone()
        while not self._stop.is_set():
            try:
                record = self._elect(ctl)
                leading = record is not None and int(str(record["rid"])) == self._rid
                if leading and self._own is None:
                    assert record is not None
                    remove_stale_segments()  # a SIGKILLed predecessor's ring, among others
                    segment = ShmSegment(str(record["shm"]), self.layout.total_bytes, create=True, slots=2)
                    self._own = SnapshotRing(self.layout, segment=segment, device=torch.device("cpu"), slots=2,
                                             lease_s=min(self._timeout_s, self._heartbeat_timeout_s))  # fmt: skip
                self.segment.follow(None if record is None else str(record["shm"]))
                if leading:
                    self.is_leader = True
                    self._lead(ctl)  # returns when the chain changes, a hop fails, or leadership is lost
                else:
                    self._step_down()
                    self._stop.wait(_CHAIN_POLL_S)
            except Exception as exc:  # noqa: BLE001 - the relay must outlive any one bad step
                if not self._stop.is_set():
                    log.warning("relay: receiver rid=%d step failed: %s", self._rid, _error_text(exc))
                    self._stop.wait(_CHAIN_POLL_S)
        self._step_down()

    def _step_down(self) -> None:
        self.is_leader = False
        if self._own is not None:
            self.segment.follow(None)
            self._own.close()
            if self._own.segment is not None:
                self._own.segment.close()
            self._own = None

    def _still_leader(self, ctl: Control) -> bool:
        raw = ctl.get_text(leader_key(self._epoch, self._host))
        return raw is not None and int(ctl.open(leader_key(self._epoch, self._host), raw)["rid"]) == self._rid

    # -- leading ------------------------------------------------------------------
    def _lead(self, ctl: Control) -> None:
        chain = read_chain(ctl, self._epoch)
        if chain is None or self._rid not in chain.rids or chain.gen == self._failed_gen:
            # A failed hop's group cannot be joined again (its store keys name the old peer,
            # which may be stalled: joining would block for timeout_s). The side that sent to
            # it marked the failure, so the sender re-forms the chain under a new generation.
            self._stop.wait(_CHAIN_POLL_S)
            return
        pos = chain.rids.index(self._rid)
        up_prefix = hop_prefix(self._epoch, chain.gen, self._rid)
        down = _Downstream(ctl, self._epoch, chain, pos, self._backend, self._addr, self._timeout_s)
        pg: PeerGroup | None = None

        def superseded() -> bool:
            current = read_chain(ctl, self._epoch)
            return self._stop.is_set() or current is None or current.gen != chain.gen or not self._still_leader(ctl)

        try:
            pg = _join_hop(ctl, up_prefix, 1, self._backend, self._addr, self._timeout_s, superseded)
            self._serve(ctl, pg, up_prefix, chain, down)
        except _Superseded:
            return
        except Exception as exc:  # noqa: BLE001 - rebuild with the next chain
            self._failed_gen = chain.gen
            if not self._stop.is_set():
                log.info("relay: rid=%d hop from upstream ended (%s)", self._rid, _error_text(exc)[:200])
                self._stop.wait(_CHAIN_POLL_S)
        finally:
            down.close()
            shutdown_group(pg)

    def _serve(self, ctl: Control, pg: PeerGroup, prefix: str, chain: Chain, down: _Downstream) -> None:
        layout = self.layout
        pieces = chunks(layout)
        nb = len(layout.buckets)
        last_piece = {bucket: i for i, (_, _, bucket) in enumerate(pieces)}
        staging = torch.empty(layout.total_bytes, dtype=torch.uint8)
        n = 0
        next_check = 0.0
        while not self._stop.is_set():
            ann = prefix + f"ann/{n}"
            while not ctl.has(ann):
                if self._stop.wait(_POLL_S):
                    return
                now = time.monotonic()
                if now >= next_check:  # a new chain or a lost election ends this hop
                    next_check = now + _CHAIN_POLL_S
                    current = read_chain(ctl, self._epoch)
                    if current is None or current.gen != chain.gen or not self._still_leader(ctl):
                        return
            ctl.delete(ann)
            header = torch.empty(4, dtype=torch.int64)
            pg.recv([header], 0, 0).wait()
            version, seq, total, count = (int(x) for x in header)
            if total != layout.total_bytes or count != len(pieces):
                raise RuntimeError(f"version {version}: layout mismatch ({total} bytes, {count} chunks)")
            forward = down.begin(header)
            works = [pg.recv([staging[a:b]], 0, 0) for a, b, _ in pieces]
            sums: list[int] = []
            hasher = xxhash.xxh3_64()
            for i, ((a, b, bucket), work) in enumerate(zip(pieces, works)):
                work.wait()
                if forward:
                    down.send(staging[a:b])
                # Hash chunk by chunk after forwarding it: a whole bucket hashed at once would hold
                # the next chunks back from the next hop (xxh3 streamed equals xxh3 in one go).
                hasher.update(staging[a:b].numpy().data)
                if last_piece[bucket] == i:
                    sums.append(to_int64(hasher.intdigest()))
                    hasher = xxhash.xxh3_64()
            trailer = torch.empty(1 + nb + MAC_WORDS, dtype=torch.int64)
            pg.recv([trailer], 0, 0).wait()
            if forward:
                down.send(trailer)
            n += 1
            self._accept(ctl, version, seq, trailer.tolist(), sums, staging)
            down.finish()

    def _accept(
        self, ctl: Control, version: int, seq: int, values: list[int], sums: list[int], staging: torch.Tensor
    ) -> None:
        nb = len(self.layout.buckets)
        if values[0] != seq:
            log.debug("relay: version %d was overwritten on the trainer during its send", version)
            return
        sent, mac = values[1 : 1 + nb], values[1 + nb :]
        expected = trailer_mac(ctl, self._epoch, _RELAY_RID, version, seq, sent)
        if not hmac.compare_digest(struct.pack(f"<{MAC_WORDS}q", *mac), struct.pack(f"<{MAC_WORDS}q", *expected)):
            self._on_rejected(version, "relayed trailer not signed with this job's secret (secret= / WSYNC_SECRET)")
            return
        bad = [i for i, (x, y) in enumerate(zip(sums, sent)) if x != y]
        if bad:
            a, b = self.layout.buckets[bad[0]]
            self._on_rejected(
                version, f"checksum mismatch on the relay in {len(bad)} bucket(s), first bytes [{a}, {b})"
            )
            return
        own = self._own
        if own is None or (self.published_version is not None and version <= self.published_version):
            return
        # Into a slot no host-mate holds; when both are held (a stalled reader, within its
        # lease) the version is skipped here, and the next one is published instead.
        if own.write(version, entry_views(self.layout, staging)) is None:
            log.warning("relay: version %d not published on this host: every slot of its ring is held", version)
            return
        self.published_version = version
        self._on_published(version)

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)


class _Downstream:
    """This leader's hop to the next one in the chain: connected in the background, never waited on long."""

    def __init__(
        self, ctl: Control, epoch: int, chain: Chain, pos: int, backend: str, addr: str, timeout_s: float
    ) -> None:
        self._ctl = ctl
        self._epoch = epoch
        self._timeout_s = timeout_s
        self._rid = chain.rids[pos + 1] if pos + 1 < len(chain.rids) else None
        self._prefix = None if self._rid is None else hop_prefix(epoch, chain.gen, self._rid)
        self._pg: PeerGroup | None = None
        self._works: list[object] = []
        self._n = 0  # messages announced on this hop
        self._broken = False
        self._ready = threading.Event()
        self._closed = threading.Event()
        self._gen = chain.gen
        self._connector: threading.Thread | None = None
        if self._rid is not None:
            self._connector = threading.Thread(
                target=self._connect, args=(backend, addr), name=f"wsync-relay-down-{self._rid}", daemon=True
            )
            self._connector.start()

    def _connect(self, backend: str, addr: str) -> None:
        assert self._prefix is not None
        ctl = self._ctl.clone()

        def superseded() -> bool:
            current = read_chain(ctl, self._epoch)
            return self._closed.is_set() or current is None or current.gen != self._gen

        try:
            self._pg = _join_hop(ctl, self._prefix, 0, backend, addr, self._timeout_s, superseded)
        except _Superseded:
            pass
        except Exception as exc:  # noqa: BLE001 - the next leader never came: drop it from the chain
            self._fail(exc)
        finally:
            self._ready.set()

    def _fail(self, exc: BaseException) -> None:
        if not self._broken and self._rid is not None:
            self._broken = True
            log.warning("relay: hop to leader rid=%d failed: %s", self._rid, _error_text(exc))
            try:
                self._ctl.set_text(broken_key(self._epoch, self._rid), "1")
            except RuntimeError:
                pass

    def begin(self, header: torch.Tensor) -> bool:
        """Announce the next version downstream; False when there is no usable next hop."""
        if self._rid is None or self._broken:
            return False
        if not self._ready.wait(_DOWNSTREAM_CONNECT_S) or self._pg is None:
            return False
        try:
            assert self._prefix is not None
            self._ctl.set_text(self._prefix + f"ann/{self._n}", "1")
            self._n += 1
            self._works = [self._pg.send([header.clone()], 1, 0)]
            return True
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return False

    def send(self, piece: torch.Tensor) -> None:
        if self._broken or self._pg is None:
            return
        try:
            self._works.append(self._pg.send([piece], 1, 0))
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def finish(self) -> None:
        """Wait for this version's sends (bounded by the group timeout)."""
        works, self._works = self._works, []
        for work in works:
            try:
                work.wait()  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
                return

    def close(self) -> None:
        self._closed.set()
        if self._connector is not None:
            self._connector.join(timeout=1.0)
        shutdown_group(self._pg)


def leader_record(ctl: Control, epoch: int, host: str) -> dict[str, object] | None:
    value = ctl.get_json(leader_key(epoch, host))
    return None if value is None else dict(value)


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
    control: Control, layout: Manifest, ordered: list[torch.Tensor], record: dict[str, object], *, epoch: int,
    rid: int, host: str, job: str, name: str, addr: str, timeout_s: float,
    on_published: Callable[[int], None], on_rejected: Callable[[int, str], None],
) -> RelaySource:  # fmt: skip
    """The data plane of a receiver on a host other than the sender's, when the sender relays."""
    segment = HostSegment(epoch, layout, ordered, name)
    member = RelayMember(
        control, layout, segment, epoch=epoch, rid=rid, host=host, job=job, backend=str(record["backend"]),
        addr=addr, timeout_s=float(str(record.get("timeout_s", timeout_s))),
        heartbeat_timeout_s=float(str(record["heartbeat_timeout_s"])),
        on_published=on_published, on_rejected=on_rejected,
    )  # fmt: skip
    return RelaySource(epoch, segment, member)
