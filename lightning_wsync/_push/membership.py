"""Receivers as the sender sees them: registration, heartbeats, and why one is gone.

A receiver registers under a fresh id (``members/next``), writes its record and then
bumps ``member/<rid>/hb`` every ``heartbeat_s``. An id whose record has not appeared
does not hold up the ids after it (its owner may have died between the two steps, or
any client may have bumped the counter): it is looked for again at each refresh and
given up after one heartbeat timeout if it has no heartbeat key (its owner died at once,
or an earlier sender retired it), else after ``_FORGET_AFTER`` heartbeat timeouts. The sender compares counter values
against its own clock, so hosts need no synchronised clocks; it reads every heartbeat in
one ``multi_get``. A receiver is gone when it closed (``gone`` key, read when the
``members/gone`` counter moves), when its process no longer exists (same host and PID namespace only), or when
its heartbeat has not moved for ``heartbeat_timeout_s``.

Longer than 300 lines: registration, the heartbeat view (and a report's re-check of it) and
why a receiver is gone are one state over the same members, kept under one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from lightning_wsync._control import keys
from lightning_wsync._control.checks import Complaints, parse_counter
from lightning_wsync._control.host import pid_alive, pid_namespace
from lightning_wsync._control.records import MemberRecord, MembersLow, MemberState
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import Timing
from lightning_wsync._planes.base import Peer
from lightning_wsync.errors import WeightSyncAuthError, WeightSyncRecordError

log = logging.getLogger(__name__)

_FORGET_AFTER = 30  # x heartbeat_timeout_s of silence: stop polling a receiver at all
_BEATS_PER_READ = 256  # per multi_get: 32,768 keys took the store 3.3 s in one, 0.08 s in 256s


@dataclass
class Member:
    rid: int
    name: str
    host: str
    pid: int
    hb: int = 0
    hb_seen_at: float = 0.0  # time.monotonic() when hb last changed
    gone_reason: str | None = None
    verify: bool = False  # wants per-bucket checksums on the shared-memory path
    pidns: int = 0  # its PID namespace (0: unknown); its pid is checked only from the same one
    gone_at: float = 0.0  # time.monotonic() when gone_reason was set
    retired: bool = False  # gone for good and its keys deleted from the store
    fleet: str | None = None  # the fleet group it switches versions with

    @property
    def label(self) -> str:
        return self.name

    @property
    def peer(self) -> Peer:
        """As the data planes see it."""
        return Peer(self.rid, self.name, self.host, self.verify)


class Membership:
    """The sender's view of the receivers, refreshed from its background thread.

    It also keeps the store bounded: the keys of a receiver gone for good are deleted
    (its planes free what they held for it: :meth:`take_changes`); ``members/low``
    records the lowest id that may still be live, so a later sender does not look
    through every id the job ever handed out. A retired receiver is forgotten here too,
    ``_FORGET_AFTER`` heartbeat timeouts later, so days of churn keep nothing.
    """

    def __init__(self, control: Control, host_id: str, timing: Timing) -> None:
        self._ctl = control
        self._host_id = host_id
        self._heartbeat_timeout_s = timing.heartbeat_timeout_s
        # members/gone says when else; a receiver that died between writing its gone key and bumping it
        # falls silent anyway
        self._gone_backstop_s = timing.gone_backstop_s
        self._pidns = pid_namespace()
        self._complaints = Complaints(log, "the sender's membership")
        try:
            low = control.get_record(keys.MEMBERS_LOW, MembersLow)
        except (WeightSyncRecordError, WeightSyncAuthError) as exc:  # look through every id instead
            self._complaints.bad(keys.MEMBERS_LOW, exc)
            low = None
        self._next_rid = self._low = 0 if low is None else max(0, low.low)
        self._unrecorded: dict[int, float] = {}  # rid reserved, record not seen yet -> since
        self._members: dict[int, Member] = {}
        self._lock = threading.Lock()
        self._gone: list[Member] = []  # since the last take_changes()
        self._retired: list[Member] = []
        self._retire_lock = threading.Lock()  # a report never reads state keys being deleted
        self.fleet_seen = False  # a receiver named a fleet group (ReceiverConfig.fleet)
        self._gone_seen: str | None = None  # members/gone as last read through (None: absent)
        self._gone_due = 0.0  # (the first refresh reads every gone key)
        self._rechecked: dict[int, float] = {}  # rid -> its hb_seen_at when a re-read found it silent still

    def refresh(self, *, members: bool = True) -> None:
        """Take in new registrations and look for members whose process exited (a local
        check, no request); with ``members``, also read every member's heartbeat and
        goodbye (two requests each: the sender asks for that at most once a second).

        The exit check runs at every call: a receiver killed mid-send is let go of (its
        link stopped, its ring slots freed) at once, not at the next full read. Without
        ``members``, a member this view newly calls silent has its heartbeat read again
        (one batched read, once per silence): the planes take the live list from here
        between full reads, and a view that merely aged past ``heartbeat_timeout_s`` (the
        last full read late on a busy thread) must not re-form the relay's chain or trees.
        """
        self._take_registrations()
        if not members:
            now = time.monotonic()
            for member in self.members():
                if member.gone_reason is None and self._exited(member):
                    self._mark_gone(member, f"process {member.pid} exited", now)
            self._recheck_newly_silent()
            return
        now = time.monotonic()
        open_ = [m for m in self.members() if m.gone_reason is None]
        beats, closed = self._heartbeats(open_), self._closed(open_, now)
        for member in self.members():
            if member.gone_reason is not None:
                # Kept a while, so reports still read what it acknowledged before leaving.
                if not member.retired and now - member.gone_at >= self._heartbeat_timeout_s:
                    self._retire(member)
                continue
            hb = beats.get(member.rid, member.hb)
            if hb != member.hb:
                member.hb, member.hb_seen_at = hb, now
            reason = "closed" if member.rid in closed else self._gone_reason(member, now)
            if reason is not None:
                self._mark_gone(member, reason, now)
        self._forget_retired(now)
        self._advance_low()

    def _mark_gone(self, member: Member, reason: str, now: float) -> None:
        member.gone_reason, member.gone_at = reason, now
        with self._lock:
            self._gone.append(member)

    def _take_registrations(self) -> None:
        ctl = self._ctl
        try:
            registered = ctl.add(keys.MEMBERS_NEXT, 0)
        except WeightSyncRecordError as exc:  # nobody can register meanwhile; the known ones go on
            self._complaints.bad(keys.MEMBERS_NEXT, exc)
            registered = self._next_rid
        now = time.monotonic()
        while self._next_rid < registered:
            self._unrecorded[self._next_rid] = now
            self._next_rid += 1
        for rid, since in list(self._unrecorded.items()):
            try:
                record = ctl.get_record(keys.member(rid), MemberRecord)
            except (WeightSyncAuthError, WeightSyncRecordError) as exc:
                log.error("refused receiver rid=%d: %s", rid, exc)
                del self._unrecorded[rid]
                continue
            if record is None:  # registering right now, or its owner died before writing it
                # A receiver writes its heartbeat key within moments of taking its id; an id
                # with no keys at all for heartbeat_timeout_s is one whose owner died at once,
                # or whose keys were deleted when an earlier sender retired it.
                started = ctl.has(keys.member_heartbeat(rid))
                if now - since > (_FORGET_AFTER if started else 1) * self._heartbeat_timeout_s:
                    del self._unrecorded[rid]
                    for key in keys.member_keys(rid):
                        self._ctl.delete(key)
                    log.info("receiver rid=%d reserved an id but never registered; forgotten", rid)
                continue
            del self._unrecorded[rid]
            self.fleet_seen = self.fleet_seen or record.fleet is not None
            member = Member(rid, record.name, record.host, record.pid, verify=record.verify, pidns=record.pidns,
                            fleet=record.fleet)  # fmt: skip
            member.hb, member.hb_seen_at = self._heartbeat(member), time.monotonic()
            with self._lock:
                self._members[member.rid] = member

    def _heartbeats(self, members: list[Member]) -> dict[int, int]:
        """Every member's heartbeat count, two requests per ``_BEATS_PER_READ`` members (a check that
        all exist, one ``multi_get``), or one each where a key is missing (a multi_get would wait)."""
        beats: dict[int, int] = {}
        for at in range(0, len(members), _BEATS_PER_READ):
            batch = members[at : at + _BEATS_PER_READ]
            hb_keys = [keys.member_heartbeat(m.rid) for m in batch]
            if not self._ctl.has_all(hb_keys):
                beats.update((m.rid, self._heartbeat(m)) for m in batch)
                continue
            for member, key, raw in zip(batch, hb_keys, self._ctl.multi_get(hb_keys)):
                count = parse_counter(raw)
                if count is None:  # garbled: no beat (its owner rewrites it)
                    self._complaints.bad(key, WeightSyncRecordError(f"counter {key!r} holds {raw[:40]!r}"))
                    continue
                self._complaints.good(key)
                beats[member.rid] = count
        return beats

    def _closed(self, members: list[Member], now: float) -> set[int]:
        """The members whose ``gone`` key is set: read when ``members/gone`` moved, and every
        ``timing.gone_backstop_s`` (a request per member), not at every refresh."""
        gone = self._ctl.get_text(keys.MEMBERS_GONE)
        if gone == self._gone_seen and now < self._gone_due:
            return set()
        self._gone_seen, self._gone_due = gone, now + self._gone_backstop_s
        return {m.rid for m in members if self._ctl.has(keys.member_gone(m.rid))}

    def _heartbeat(self, member: Member) -> int:
        """The member's heartbeat count; a garbled one counts as no beat (its owner rewrites it)."""
        key = keys.member_heartbeat(member.rid)
        try:
            count = self._ctl.add(key, 0)
        except WeightSyncRecordError as exc:
            self._complaints.bad(key, exc)
            return member.hb
        self._complaints.good(key)
        return count

    def take_changes(self) -> tuple[list[Peer], list[Peer]]:
        """Receivers gone, and retired, since the last call (for the planes to let go of)."""
        with self._lock:
            gone, retired = self._gone, self._retired
            self._gone, self._retired = [], []
        return [m.peer for m in gone], [m.peer for m in retired]

    def _retire(self, member: Member) -> None:
        """Delete the keys of a receiver gone for good (reports keep its name and reason)."""
        with self._lock:
            self._retired.append(member)  # its network plane deletes its link counter and groups
        with self._retire_lock:
            member.retired = True
            for key in keys.member_keys(member.rid):
                if key != keys.member_link(member.rid):
                    self._ctl.delete(key)

    def _forget_retired(self, now: float) -> None:
        with self._lock:
            for rid, m in list(self._members.items()):
                if m.retired and now - m.gone_at >= _FORGET_AFTER * self._heartbeat_timeout_s:
                    del self._members[rid]

    def _advance_low(self) -> None:
        with self._lock:
            open_rids = [rid for rid, m in self._members.items() if not m.retired]
        low = min([*open_rids, *self._unrecorded, self._next_rid])
        if low > self._low:
            self._ctl.put(keys.MEMBERS_LOW, MembersLow(low))
            self._low = low

    def _gone_reason(self, member: Member, now: float) -> str | None:
        """Why ``member`` is gone for good (a merely silent one may still come back)."""
        if self._exited(member):
            return f"process {member.pid} exited"
        silent = now - member.hb_seen_at
        if silent > _FORGET_AFTER * self._heartbeat_timeout_s:
            return f"no heartbeat for {silent:.1f} s"
        return None

    def recheck_silent(self) -> list[Member]:
        """Read again the heartbeat of each member this view calls silent (and not gone); return
        those found beating. The view moves only at a full :meth:`refresh`, which a busy sender
        thread can leave older than ``heartbeat_timeout_s`` while receivers beat on: a push
        report asks the store before it leaves such a receiver out or fails it."""
        return self._reread(self._silent())

    def _recheck_newly_silent(self) -> None:
        """:meth:`recheck_silent` for the members silent in this view since their last beat seen
        and not yet re-read in this silence: a leader the store still sees beating stays live; one
        that stopped is re-read once and left silent (its silence is then read at each full refresh)."""
        newly = [m for m in self._silent() if self._rechecked.get(m.rid) != m.hb_seen_at]
        if not newly:
            return
        beating = {m.rid for m in self._reread(newly)}
        self._rechecked = {rid: seen for rid, seen in self._rechecked.items() if self.get(rid) is not None}
        for member in newly:
            if member.rid not in beating:
                self._rechecked[member.rid] = member.hb_seen_at

    def _silent(self) -> list[Member]:
        return [m for m in self.members() if m.gone_reason is None and self._silent_reason(m) is not None]

    def _reread(self, silent: list[Member]) -> list[Member]:
        """Read the heartbeats of ``silent`` (one batched read); return those that moved."""
        if not silent:
            return []
        beats, now, beating = self._heartbeats(silent), time.monotonic(), []
        for member in silent:
            hb = beats.get(member.rid, member.hb)
            if hb != member.hb:
                member.hb, member.hb_seen_at = hb, now
                beating.append(member)
        return beating

    def is_silent(self, rid: int) -> bool:
        """This view calls ``rid`` silent (no beat seen for ``heartbeat_timeout_s``), not gone."""
        member = self.get(rid)
        return member is not None and member.gone_reason is None and self._silent_reason(member) is not None

    def _silent_reason(self, member: Member) -> str | None:
        silent = time.monotonic() - member.hb_seen_at
        if silent > self._heartbeat_timeout_s:
            return f"no heartbeat for {silent:.1f} s (heartbeat_timeout_s={self._heartbeat_timeout_s})"
        return None

    def read_states(self, ctl: Control, rids: list[int]) -> list[bytes]:  # decoded by the report
        """The raw ``member/<rid>/state`` of each of ``rids`` (a check and a multi_get): a retired or
        forgotten receiver, or one whose key is gone, reads as holding nothing (its gone reason stands)."""
        with self._retire_lock:
            read = [keys.member_state(rid) for rid in rids if (m := self.get(rid)) is not None and not m.retired]
            found = ctl.get_present(read)  # a key gone since the refresh must not hold a multi_get
        held_none = MemberState(-1).encode()
        return [found.get(key) or ctl.seal(key, held_none).encode() for key in map(keys.member_state, rids)]

    def members(self) -> list[Member]:
        with self._lock:
            return list(self._members.values())

    def live(self) -> list[Member]:
        """Members that are neither gone, nor exited since the last refresh, nor silent past
        ``heartbeat_timeout_s``: a push right after a receiver died does not target it."""
        return [m for m in self.members() if self.failure(m.rid) is None]

    def get(self, rid: int) -> Member | None:
        with self._lock:
            return self._members.get(rid)

    def failure(self, rid: int) -> str | None:
        """Why ``rid`` cannot take deliveries now, or None while it looks healthy."""
        member = self.get(rid)
        if member is None:
            return "unknown receiver"
        if member.gone_reason is not None:
            return member.gone_reason
        if (silent := self._silent_reason(member)) is not None:
            return silent
        if self._exited(member):
            return f"process {member.pid} exited"
        return None

    def _exited(self, member: Member) -> bool:
        """Its process is gone, judged only where its pid means it: the same host and PID
        namespace (a container sharing this host's id and IPC has PIDs of its own)."""
        same = member.host == self._host_id and member.pidns == self._pidns != 0
        return same and not pid_alive(member.pid)

    def heartbeat_age_s(self, rid: int) -> float | None:
        member = self.get(rid)
        return None if member is None else time.monotonic() - member.hb_seen_at
