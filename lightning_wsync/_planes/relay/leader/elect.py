"""Electing a relay host's leader through the store (``relay/<epoch>/leader/<hostkey>``).

The record names the leader's receiver id, its PID and PID namespace, a term that each
takeover bumps, the host segment it serves, and whether that segment exists yet. A
host-mate replaces the leader by compare-and-set when it is gone: closed (its ``gone``
key, or its keys deleted), exited (judged by PID only from the leader's own PID
namespace: containers that share a host id see each other's PIDs as meaningless), or
silent (its heartbeat has not moved for ``heartbeat_timeout_s``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from lightning_wsync._control import keys
from lightning_wsync._control.checks import Complaints
from lightning_wsync._control.host import pid_alive, pid_namespace
from lightning_wsync._control.records import LeaderRecord
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import Timing
from lightning_wsync._control.untrusted import Untrusted, counter
from lightning_wsync._planes.relay.hops import ring_bell
from lightning_wsync._planes.relay.tidy import peek
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)


class Election:
    """One receiver's view of its host's leader: reads, judges, takes over, resigns.

    ``standing=False``: this receiver no longer takes over (it could not create the host
    segment, or cannot open a leader's); it still follows the record.
    """

    def __init__(self, *, epoch: int, host: str, rid: int, shm: str, timing: Timing) -> None:
        self.key = keys.relay_leader(epoch, host)
        self.standing = True
        self._epoch = epoch
        self._host = host
        self._rid = rid
        self._shm = shm
        self._pidns = pid_namespace()
        self._heartbeat_timeout_s = timing.heartbeat_timeout_s
        self._check_s = timing.leader_check_s
        # The leader's (rid, heartbeat as written, seen at): compared as text, so that a garbled
        # counter that never moves is a silent leader, and one the leader writes over is a beat.
        self._seen: tuple[int, str, float] | None = None
        self._complaints = Complaints(log, f"relay: host {host}'s election")
        self._next_check = 0.0  # when the leader's gone key and heartbeat are read next
        self._refused: str | None = None  # the last unreadable record, reported once
        self._last: LeaderRecord | None = None  # the last readable record: what an unreadable one replaced

    def read(self, ctl: Control) -> tuple[str | None, LeaderRecord | None]:
        """The raw record and what it says; an unreadable (forged, garbled) one reads as no leader."""
        raw = peek(ctl, self.key)
        if raw is None:
            return None, None
        try:
            record = ctl.decode(self.key, raw, LeaderRecord)
        except WeightSyncError as exc:  # WeightSyncRecordError, WeightSyncAuthError: replaced like a dead one
            if self._refused != raw:
                log.warning("relay: host %s: %s; a host-mate replaces it", self._host, exc)
                self._refused = raw
            return raw, None
        if self._last is None or record.term >= self._last.term:
            self._last = record
        return raw, record

    def elect(self, ctl: Control, *, suspect: tuple[int, str] | None = None) -> LeaderRecord | None:
        """The host's leader after this poll: the current one, or this receiver if it took over.

        ``suspect``: (rid, why) the host itself says that leader is gone (its board went silent).
        """
        raw, record = self.read(ctl)
        if not self.standing:
            return record
        if record is None:
            reason: str | None = "no leader" if raw is None else "its record is unreadable"
        elif suspect is not None and suspect[0] == record.rid != self._rid:
            reason = suspect[1]
        else:
            reason = self._gone(ctl, record)
        if reason is None:
            return record
        # An unreadable record replaces the last one read (issue 32): its term goes on, and its
        # leader, which may still serve on what its bell last read, is rung like any replaced one.
        replaced = record if record is not None or raw is None else self._last
        mine = LeaderRecord(rid=self._rid, pid=os.getpid(), term=0 if replaced is None else replaced.term + 1,
                            shm=self._shm, pidns=self._pidns, ready=False)  # fmt: skip
        sealed = ctl.seal(self.key, mine.encode())
        now = ctl.compare_set(self.key, raw or "", sealed).decode("utf-8", "replace")
        if now == sealed:
            log.info("relay: receiver rid=%d leads host %s (term %d; %s)", self._rid, self._host, mine.term, reason)
            if replaced is not None:  # the one replaced stops serving at once if it still can
                ring_bell(ctl, self._epoch, replaced.rid)
            ctl.bump(keys.relay_moved(self._epoch))  # the sender reads the leader records again
            return mine
        return self.read(ctl)[1] if now else None

    def mark_ready(self, ctl: Control) -> None:
        """Say that this leader's segment exists (a host-mate that then cannot open it stops waiting)."""
        raw, record = self.read(ctl)
        if raw is not None and record is not None and record.rid == self._rid and not record.ready:
            ctl.compare_set(self.key, raw, ctl.seal(self.key, dataclasses.replace(record, ready=True).encode()))

    def resign(self, ctl: Control) -> None:
        """Delete the record if it names this receiver: a host-mate takes over at its next poll."""
        _, record = self.read(ctl)
        if record is not None and record.rid == self._rid:
            ctl.delete(self.key)
            ctl.bump(keys.relay_moved(self._epoch))

    def named(self, ctl: Control) -> bool:
        """The store's leader record names this receiver (what its bell caches: :attr:`Bell.named`;
        whether it leads its host is :attr:`RelayMember.leads`, which holds the host's ring)."""
        _, record = self.read(ctl)
        return record is not None and record.rid == self._rid

    def _gone(self, ctl: Control, record: LeaderRecord) -> str | None:
        if record.rid == self._rid:
            return None
        if record.pidns != 0 and record.pidns == self._pidns and not pid_alive(record.pid):
            return f"leader rid={record.rid} (pid {record.pid}) is gone"
        seen = self._seen
        now = time.monotonic()
        if seen is not None and seen[0] == record.rid and now < self._next_check:
            return None
        # The leader's pid is looked at every CHAIN_POLL_S, its gone key and heartbeat every
        # timing.leader_check_s: every receiver on every host runs this loop, and two store
        # requests each CHAIN_POLL_S were most of a host's steady load on the store.
        self._next_check = now + self._check_s
        if ctl.has(keys.member_gone(record.rid)):
            return f"leader rid={record.rid} left"
        text = peek(ctl, keys.member_heartbeat(record.rid))  # never add(): a deleted key stays deleted
        if text is None:
            return f"leader rid={record.rid} is gone (its keys were deleted)"
        try:
            counter(text, keys.member_heartbeat(record.rid))
            self._complaints.good(keys.member_heartbeat(record.rid))
        except Untrusted as exc:  # reported once; judged as a counter that does not move
            self._complaints.bad(keys.member_heartbeat(record.rid), exc)
        hb = text
        if seen is None or seen[0] != record.rid or seen[1] != hb:
            self._seen = (record.rid, hb, now)
            return None
        if now - seen[2] > self._heartbeat_timeout_s:
            return (f"leader rid={record.rid} silent for {now - seen[2]:.1f} s "
                    f"(heartbeat_timeout_s={self._heartbeat_timeout_s})")  # fmt: skip
        return None
