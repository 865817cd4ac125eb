"""The sharded plane's send side, on trainer rank 0: it watches the other ranks' rings (read
only, on this host; a relaying rank on another host by its note on the store) to tell push
reports which rank's share of a version is missing, and publishes every share's checksums for
receivers that verify: of the rings on this host as it reads them, of a relaying rank on another
host as that rank noted them on the store (``shards/<epoch>/sums/<rank>``).

The watching runs on a thread of its own (``wsync-shard-wait``), never the sender's background
thread: that one goes on publishing versions and reading heartbeats while a share is awaited,
so a rank that never writes its share is named in the push report, not every receiver called
silent. Versions are watched side by side, each against its own deadline."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from lightning_wsync._control import keys
from lightning_wsync._control.checks import Complaints
from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.shards import ShardPlan
from lightning_wsync._control.store import Control
from lightning_wsync._control.untrusted import Untrusted, counter
from lightning_wsync._planes.base import Delivery, Peer
from lightning_wsync._planes.shm.pins import ReaderPin
from lightning_wsync._planes.shm.ring import Lease, SnapshotRing
from lightning_wsync._planes.shm.segment import ShmReader, SlotRef
from lightning_wsync.errors import WeightSyncAuthError, WeightSyncRecordError

log = logging.getLogger(__name__)

_POLL_S = 0.001
_AWAY_POLL_S = 0.02  # a rank on another host is read from the store, not its ring: less often
# A push report gives up on a receiver timeout_s after the push; its version is published (and
# watched here) a little later. The verdict on a missing share comes this much earlier, so the
# report names the rank instead of calling its receivers silent.
_AHEAD_MAX_S = 0.5
_VERDICTS_KEPT = 64  # versions whose missing share is remembered for their reports (a report waits timeout_s)


class ShardSendPlane:
    """Rank 0's view of every rank's share; receivers read the rings themselves."""

    def __init__(
        self, ctl: Control, ring: SnapshotRing, plan: ShardPlan, shares: Sequence[Manifest], *, host: str,
        timeout_s: float, epoch: int, relayed: bool,
    ) -> None:  # fmt: skip
        """The rings of ranks on this host (``host``) are read; a rank on another host notes each version it
        wrote, and its share's checksums, on the store when it relays (``relayed``), else it is not watched
        and no checksums are published (no receiver on another host could be served then)."""
        self._ctl = ctl
        self._ring = ring
        self._timeout_s = timeout_s
        hosts = plan.rank_hosts(host)
        self._ranks = [rank for rank in range(1, plan.world) if hosts[rank] == host]  # read here, in order
        self._everyone_here = len(self._ranks) == plan.world - 1
        away = [rank for rank in range(1, plan.world) if hosts[rank] != host] if relayed else []
        self._away = {rank: keys.shard_written(epoch, rank) for rank in away}
        self._away_sums = {rank: keys.shard_sums(epoch, rank) for rank in away}
        self._sums_read_at = 0.0
        self._world = plan.world
        self._checks = self._everyone_here or relayed  # every rank's checksums can be had
        self._away_wrote: dict[int, int] = {}  # rank -> the newest version it noted
        self._away_read_at = 0.0
        self._complaints = Complaints(log, "the sharded plane's rank 0")
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._others: list[ShmReader] = []
        try:
            for rank in self._ranks:
                self._others.append(ShmReader(plan.segments[rank], shares[rank]))
        except BaseException:
            self.close(0.0)
            raise
        self._missing: dict[int, int] = {}  # version -> the first rank missing its share, per settled version
        self._warned: set[int] = set()  # ranks whose missing share was logged (again once they complete one)
        self._watched: dict[int, tuple[float, bool]] = {}  # version -> (deadline, publish checksums)
        self._unsummed: int | None = None  # the newest version, published while no live receiver verified
        self._thread = threading.Thread(target=self._run, name="wsync-shard-wait", daemon=True)
        self._thread.start()

    def sync(self, live: Sequence[Peer], gone: Sequence[Peer], retired: Sequence[Peer]) -> None:
        """Readers pin slots themselves (a dead reader's pin expires); a receiver that verifies and joined after
        the newest push has that version watched again, to publish its checksums now."""
        version = self._unsummed
        if version is not None and self._checks and any(p.verify for p in live):
            self._unsummed = None
            with self._cond:
                self._watched[version] = (time.monotonic() + self._timeout_s, True)
                self._cond.notify()

    def _missing_ranks(self, version: int) -> list[int]:
        """Ranks (>= 1) that have written neither ``version`` nor a newer version: by their ring on this host,
        by their note on the store (read every ``_AWAY_POLL_S``) on another."""
        here = [rank for rank, reader in zip(self._ranks, self._others)
                if not any(ref.version >= version for ref in reader.complete())]  # fmt: skip
        if self._away and time.monotonic() >= self._away_read_at:
            self._away_read_at = time.monotonic() + _AWAY_POLL_S
            for rank, key in self._away.items():
                text = self._ctl.get_text(key)
                if text is None:
                    continue
                try:
                    self._away_wrote[rank] = counter(text, key)
                    self._complaints.good(key)
                except Untrusted as exc:  # unsigned: reported once, read as not written
                    self._complaints.bad(key, exc)
        away = [rank for rank in self._away if self._away_wrote.get(rank, -1) < version]
        return sorted(here + away)

    def published(self, version: int, live: Sequence[Peer]) -> None:
        """Watch ``version`` (on this plane's thread; returns at once): once every rank's share of it is
        complete, publish checksums for verifying receivers; past ``timeout_s``, name the missing rank."""
        ahead = min(_AHEAD_MAX_S, self._timeout_s / 10)
        verify = self._checks and any(p.verify for p in live)
        self._unsummed = None if verify else version
        with self._cond:
            self._watched[version] = (time.monotonic() + self._timeout_s - ahead, verify)
            self._cond.notify()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: bool(self._watched) or self._stop.is_set())
                watched = sorted(self._watched.items())
            for version, (deadline, verify) in watched:
                try:
                    done = self._watch(version, deadline, verify)
                except Exception:  # noqa: BLE001 - a dead watcher would name no rank again
                    log.exception("the sharded plane's watch of version %d failed", version)
                    done = True
                if done:
                    with self._cond:
                        self._watched.pop(version, None)
            self._stop.wait(_POLL_S)

    def _watch(self, version: int, deadline: float, verify: bool) -> bool:
        """One look at ``version``; True once it is settled (complete, or past its deadline)."""
        missing = self._missing_ranks(version)
        if missing and time.monotonic() < deadline:
            return False
        if missing:
            self._missing[version] = missing[0]
            while len(self._missing) > _VERDICTS_KEPT:  # the oldest first: reports of those are long settled
                del self._missing[min(self._missing)]
            level = logging.DEBUG if missing[0] in self._warned else logging.WARNING
            self._warned.add(missing[0])
            log.log(level, "trainer rank %d did not complete its share of version %d within timeout_s=%s: no "
                    "receiver applies that version (all shares or none)", missing[0], version,
                    self._timeout_s)  # fmt: skip
            return True
        self._warned.clear()
        if verify:
            sums = self._checksums(version)
            if sums is None and self._away_pending(version) and time.monotonic() < deadline:
                return False  # a rank on another host notes its checksums after its share: look again
            if sums is not None:
                self._ctl.set_json(keys.version_sums(version), {"version": version, "sums": sums})
        return True

    def _away_sums_of(self, version: int) -> dict[int, list[int]] | None:
        """The checksums of ``version`` that every rank on another host noted (read every ``_AWAY_POLL_S``);
        None while any has not (or noted a newer version: then they are gone)."""
        if not self._away_sums:
            return {}
        if time.monotonic() < self._sums_read_at:
            return None
        self._sums_read_at = time.monotonic() + _AWAY_POLL_S
        found: dict[int, list[int]] = {}
        for rank, key in self._away_sums.items():
            try:
                note = self._ctl.get_json(key)
                self._complaints.good(key)
            except (WeightSyncRecordError, WeightSyncAuthError) as exc:  # said once; read as not noted
                self._complaints.bad(key, exc)
                return None
            if not isinstance(note, dict) or note.get("version") != version:
                return None
            sums = note.get("sums")
            if not isinstance(sums, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in sums):
                self._complaints.bad(key, WeightSyncRecordError(f"{key}: checksums are not a list of ints"))
                return None
            found[rank] = sums
        return found

    def _away_pending(self, version: int) -> bool:
        """Some rank on another host has not noted checksums of ``version`` nor of a newer one (so they may come)."""
        return any(self._away_wrote.get(rank, -1) <= version for rank in self._away_sums)

    def _checksums(self, version: int) -> list[int] | None:
        """Every rank's bucket checksums of ``version``, rank by rank; None once any was overwritten, or while a
        rank on another host has not noted its own."""
        away = self._away_sums_of(version)
        if away is None:
            return None
        ref = self._ring.find(version)
        lease = None if ref is None else self._ring.acquire(ref)
        if lease is None:
            return None
        try:
            sums = self._ring.checksums(lease)
        finally:
            lease.release()
        if sums is None:
            return None
        by_rank: dict[int, list[int]] = {0: sums, **away}
        for rank, reader in zip(self._ranks, self._others):
            theirs: SlotRef | None = next((r for r in reader.complete() if r.version == version), None)
            if theirs is None or not reader.pin(theirs):
                return None
            try:
                part = reader.checksums(theirs)
            finally:
                intact = reader.unpin(theirs)
            if not intact:
                return None
            by_rank[rank] = part
        return [s for rank in range(self._world) for s in by_rank[rank]]

    def hold(self, version: int) -> SharesHold | None:
        """Hold ``version`` in every ring on this host (``base.Snapshots``, for a fleet round): rank 0's slot
        leased, every other rank's slot pinned, so that no share of the round's target is overwritten while
        the fleet stages it; None unless each of them holds the version complete now."""
        ref = self._ring.find(version)
        lease = None if ref is None else self._ring.acquire(ref)
        if lease is None:
            return None
        pins: list[ReaderPin] = []
        for reader in self._others:
            theirs = next((r for r in reader.complete() if r.version == version), None)
            pin = None if theirs is None else reader.hold(theirs)
            if pin is None:
                SharesHold(lease, pins).release()
                return None
            pins.append(pin)
        return SharesHold(lease, pins)

    def deliveries(self, version: int, peers: Sequence[Peer]) -> dict[str, Delivery]:
        return {}  # always the whole version, copied from the rings

    def failure(self, rid: int, version: int) -> str | None:
        """The verdict on ``version`` alone: a report of one version never names another's missing share."""
        rank = self._missing.get(version)
        if rank is None:
            return None
        return (f"trainer rank {rank} did not complete its share of version {version} within "
                f"timeout_s={self._timeout_s} (it died, stalled, or dropped that push): no receiver applies "
                f"version {version}")  # fmt: skip

    @property
    def superseded(self) -> int:
        return 0

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def close(self, deadline: float) -> list[str]:
        self.stop()
        thread = getattr(self, "_thread", None)  # absent when __init__ failed before starting it
        if thread is not None:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [thread.name] if thread is not None and thread.is_alive() else []
        if not stuck:
            others, self._others = self._others, []
            for reader in others:
                reader.close()
        return stuck


class SharesHold:
    """A fleet round's hold on one version of a sharded push (``base.SlotHold``): rank 0's ring lease and a pin
    in the ring of every other rank on this host. Ranks on other hosts are not held: their shares reach the
    fleet's hosts through relay streams, whose host rings their leaders keep."""

    def __init__(self, lease: Lease, pins: list[ReaderPin]) -> None:
        self._lease = lease
        self._pins = pins

    def touch(self) -> None:
        self._lease.touch()
        for pin in self._pins:
            pin.touch()

    def release(self) -> None:
        self._lease.release()
        pins, self._pins = self._pins, []
        for pin in pins:
            pin.release()
            pin.close()

    def checksums(self) -> list[int] | None:
        return None  # one share's would not do: members check the version's own sums record (every rank's)
