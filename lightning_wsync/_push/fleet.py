"""One version across a fleet: the sender's side of ``ReceiverConfig.fleet``.

Receivers registered with ``fleet=<group>`` apply only versions their group switched
to. The sender runs the group's rounds on a thread of its own (:class:`FleetCoordinator`),
started when the first receiver naming a group registers::

    open     target T = the newest version published; the sender leases T's slot of its
             snapshot ring for the whole round (pushes go on into the other slot; with a
             sharded push, T's slot of every trainer rank's ring on its host), and
             writes fleet/<group>/round = {round, T, rids}: the live members taking part
    stage    each member copies exactly T into a private copy and says so on
             member/<rid>/fleet (it holds T there until it has applied it)
    switch   once every member of rids staged T, or timeout_s after the open: the
             signed record fleet/<group>/switch gets {round, T, rids that staged it,
             excluded: name -> why, at}; members apply T at their next update()

One target per round, held in the ring until the round ends, so pushes faster than the
members stage never make them chase a moving version (no livelock). A member left out
(stalled, slow, gone) is not waited for again until its own record shows it has caught
up (it saw a later round and holds nothing unapplied): it then takes part in the next
round. A new member is taken in the same way, once it follows the sender and has seen
the newest round, so a member still starting never holds a round up. The trainer's
``push()`` never waits for any of this; at worst one ring slot is held per group, so a
push finding the other slot being read is dropped as usual.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_wsync._control import keys
from lightning_wsync._control.checks import Complaints
from lightning_wsync._control.fleet_records import FleetAck, FleetRound, FleetSwitch, FleetSwitches
from lightning_wsync._control.store import STORE_ERRORS, Control
from lightning_wsync._control.timing import Timing
from lightning_wsync._planes.base import SlotHold, Snapshots
from lightning_wsync._push.membership import Member, Membership
from lightning_wsync.errors import WeightSyncAuthError, WeightSyncRecordError

log = logging.getLogger(__name__)

KEEP_SWITCHES = 8  # switches kept in fleet/<group>/switch (and here, for push reports)


@dataclass
class _Group:
    name: str
    next_round: int = 0
    open: FleetRound | None = None
    lease: SlotHold | None = None
    opened_at: float = 0.0
    last_version: int = -1
    left_out: dict[int, int] = field(default_factory=dict)  # rid -> the round it must have seen to come back
    known: set[int] = field(default_factory=set)  # rids seen in this group
    joining: set[int] = field(default_factory=set)  # new, not in a round yet
    history: list[FleetSwitch] = field(default_factory=list)


class FleetCoordinator:
    """Runs the rounds of every fleet group the sender's receivers name.

    Args:
        ctl: a control of its own (the thread's).
        members: the sender's membership (members carry their ``fleet`` group).
        ring: what the targets are leased from: the sender's snapshot ring, or with a sharded push every
            rank's ring on the sender's host (a round's target is then kept in each of them).
        published: the newest version the sender has published, or None.
        timing: the sender's (``timeout_s``: how long a round waits for its members; its polls).
        partial: ``ring`` holds trainer rank 0's share only (a sharded push): a round carries no
            checksums, and verifying members check the version's own sums record (every rank's).
    """

    def __init__(
        self,
        ctl: Control,
        members: Membership,
        ring: Snapshots,
        published: Callable[[], int | None],
        timing: Timing,
        *,
        partial: bool = False,
    ) -> None:
        self._ctl = ctl
        self._partial = partial
        self._members = members
        self._ring = ring
        self._published = published
        self.timeout_s = timing.timeout_s
        self.timing = timing
        self._groups: dict[str, _Group] = {}
        self._lock = threading.Lock()
        self._complaints = Complaints(log, "the fleet coordinator")
        self._stop = threading.Event()
        self._start_lock = threading.Lock()  # start() on the sender's thread, close() on the caller's
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the rounds' thread, once, unless closed: a sender starts it when a receiver
        names a fleet group, so without fleet receivers nothing polls."""
        with self._start_lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(
                target=_run, args=(weakref.ref(self), self._stop), name="wsync-fleet", daemon=True
            )
            self._thread.start()
        log.debug("fleet coordinator started")

    def switches(self, group: str) -> list[FleetSwitch]:
        """The group's newest few switches, oldest first."""
        with self._lock:
            g = self._groups.get(group)
            return [] if g is None else list(g.history)

    def switched_for(self, version: int) -> dict[str, FleetSwitch]:
        """Per group, its first switch to ``version`` or a newer one (as far as kept)."""
        with self._lock:
            groups = list(self._groups.values())
        out: dict[str, FleetSwitch] = {}
        for g in groups:
            first = next((s for s in list(g.history) if s.version >= version), None)
            if first is not None:
                out[g.name] = first
        return out

    def close(self) -> None:
        with self._start_lock:
            self._stop.set()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)
        for g in self._groups.values():
            if g.lease is not None:
                g.lease.release()
                g.lease = None

    # -- the thread's step -----------------------------------------------------------
    def step(self) -> bool:
        """One look at every group; True while a round is open."""
        live = [m for m in self._members.live() if m.fleet is not None]
        acks = self._acks(live)
        by_group: dict[str, list[Member]] = {}
        for m in live:
            assert m.fleet is not None
            by_group.setdefault(m.fleet, []).append(m)
        busy = False
        for name in sorted(set(by_group) | {n for n, g in self._groups.items() if g.open is not None}):
            g = self._groups.get(name) or self._new_group(name)
            group_live = by_group.get(name, [])
            if g.open is None:
                self._open(g, group_live, acks)
            else:
                self._settle(g, group_live, acks)
            busy = busy or g.open is not None
        return busy

    def _new_group(self, name: str) -> _Group:
        g = _Group(name)
        try:  # a later sender of the job numbers its rounds on from the last one
            previous = self._ctl.get_record(keys.fleet_round(name), FleetRound)
        except (WeightSyncRecordError, WeightSyncAuthError) as exc:
            self._complaints.bad(keys.fleet_round(name), exc)
            previous = None
        g.next_round = 0 if previous is None else previous.round + 1
        with self._lock:
            self._groups[name] = g
        return g

    def _acks(self, live: list[Member]) -> dict[int, FleetAck]:
        """What each fleet member last said (its key is written before it registers)."""
        if not live:
            return {}
        raws = self._ctl.get_present([keys.member_fleet(m.rid) for m in live])  # one retired since: no key
        out: dict[int, FleetAck] = {}
        for m in live:
            key = keys.member_fleet(m.rid)
            if (raw := raws.get(key)) is None:
                continue
            try:
                out[m.rid] = self._ctl.decode(key, raw, FleetAck)
                self._complaints.good(key)
            except (WeightSyncRecordError, WeightSyncAuthError) as exc:
                self._complaints.bad(key, exc)
        return out

    def _open(self, g: _Group, live: list[Member], acks: dict[int, FleetAck]) -> None:
        for rid in [r for r in g.left_out if (m := self._members.get(r)) is None or m.retired]:
            del g.left_out[rid]  # gone for good: forgotten here too
        for m in live:
            if m.rid not in g.known:  # new: taken in once it follows the sender and sees the rounds
                g.known.add(m.rid)
                g.left_out[m.rid] = g.next_round - 1
                g.joining.add(m.rid)
        g.known &= {m.rid for m in self._members.members()}
        g.joining &= g.known
        for m in live:  # a member left out comes back once it has caught up
            ack = acks.get(m.rid)
            since = g.left_out.get(m.rid)
            if since is not None and ack is not None and ack.round >= since and not ack.holding:
                del g.left_out[m.rid]
                g.joining.discard(m.rid)
        rids = tuple(sorted(m.rid for m in live if m.rid not in g.left_out))
        version = self._published()
        if not rids or version is None or version <= g.last_version:
            return
        lease = self._ring.hold(version)
        if lease is None:
            return  # overwritten already: the next published version opens the round
        sums: tuple[int, ...] = ()
        if any(m.verify for m in live if m.rid in rids):
            found = lease.checksums()
            if found is None or self._partial:  # a GPU ring, one share: members check the version's own sums record
                found = []
            sums = tuple(found)
        g.open, g.lease, g.opened_at = FleetRound(g.next_round, version, rids, sums), lease, time.monotonic()
        g.next_round += 1
        self._ctl.put(keys.fleet_round(g.name), g.open)
        log.debug("fleet %r round %d: version %d for rids %s", g.name, g.open.round, version, rids)

    def _settle(self, g: _Group, live: list[Member], acks: dict[int, FleetAck]) -> None:
        assert g.open is not None and g.lease is not None
        g.lease.touch()  # the members are still copying it
        target = g.open
        by_rid = {m.rid: m for m in self._members.members() if m.rid in target.rids}
        live_rids = {m.rid for m in live}
        staged = [
            rid for rid in target.rids if rid in live_rids and (a := acks.get(rid)) and a.staged == target.version
        ]
        waiting = [rid for rid in target.rids if rid in live_rids and rid not in staged]
        late = time.monotonic() - g.opened_at >= self.timeout_s
        if waiting and not late:
            return
        excluded: dict[str, str] = {}
        newly = []
        for rid in target.rids:
            if rid in staged:
                continue
            m = by_rid.get(rid)
            label = m.label if m is not None else f"rid {rid}"
            if rid in live_rids:
                excluded[label] = f"did not stage version {target.version} within timeout_s={self.timeout_s}"
            else:
                excluded[label] = f"left the job during the round ({self._members.failure(rid) or 'gone'})"
            g.left_out[rid] = target.round + 1
            newly.append(label)
        for m in live:
            if m.rid in g.joining:
                excluded.setdefault(m.label, "joining: takes part once it follows the sender and saw a round")
            elif m.rid in g.left_out and m.rid not in target.rids:
                excluded.setdefault(m.label, f"left out since round {g.left_out[m.rid] - 1}; not caught up yet")
        if newly and staged:
            log.warning("fleet %r switched to version %d without %s", g.name, target.version,
                        {n: excluded[n] for n in newly})  # fmt: skip
        self._switch(g, FleetSwitch(target.round, target.version, tuple(staged), excluded, time.time()))

    def _switch(self, g: _Group, switch: FleetSwitch) -> None:
        if switch.rids:
            history = [*g.history, switch][-KEEP_SWITCHES:]
            self._ctl.put(keys.fleet_switch(g.name), FleetSwitches(tuple(history)))
            with self._lock:  # after the store: a switch seen here is one members can apply
                g.history = history
        else:
            log.info("fleet %r: no member staged version %d (%s)", g.name, switch.version, switch.excluded)
        g.last_version = switch.version
        assert g.lease is not None
        g.lease.release()
        g.open, g.lease = None, None


def _run(ref: weakref.ReferenceType[FleetCoordinator], stop: threading.Event) -> None:
    """The coordinator's thread; holds it only weakly."""
    while not stop.is_set():
        coordinator = ref()
        if coordinator is None:
            return
        try:
            busy = coordinator.step()
        except STORE_ERRORS as exc:  # the store, a bad record
            log.warning("fleet coordinator step failed (will retry): %s", str(exc).strip()[:300])
            busy = False
        except Exception:  # noqa: BLE001 - a dead coordinator would stall every fleet member
            log.exception("fleet coordinator step failed (will retry)")
            busy = False
        poll_s = coordinator.timing.fleet_poll_s if busy else coordinator.timing.fleet_idle_poll_s
        del coordinator
        stop.wait(poll_s)
