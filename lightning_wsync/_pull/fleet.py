"""A receiver's side of one version across a fleet (``ReceiverConfig.fleet``).

A receiver with ``fleet=<group>`` writes every version into a private copy first (its
*staged* version) and applies one only when its group switched to it (the sender's
rounds: :mod:`lightning_wsync._push.fleet`). A :class:`FleetMember` thread follows
``fleet/<group>/round`` and stages exactly the round's target (the sender keeps it in
its ring for the round), then says so on ``member/<rid>/fleet``. Once a switch record
that names this receiver holds its staged version, that copy is *held* (never
overwritten) until ``update()`` has applied it; ``update()`` reads the switch record
itself (one store read), so two members asked at the same moment apply the same switch.
An apply target (an engine's loader) may keep the tensors it was handed until the next
``update()``: the copy is not overwritten before that call (a module's copy is taken at once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lightning_wsync._control import keys
from lightning_wsync._control.checks import Complaints
from lightning_wsync._control.fleet_records import NOT_FOLLOWING, FleetAck, FleetRound, FleetSwitch, FleetSwitches
from lightning_wsync._control.records import R, SumsRecord
from lightning_wsync._control.store import Control
from lightning_wsync._pull.watcher import Watcher
from lightning_wsync.errors import (
    WeightSyncAuthError,
    WeightSyncIntegrityError,
    WeightSyncRecordError,
    WeightSyncStoreError,
)

log = logging.getLogger(__name__)


class FleetMember:
    """Stages each round's target for a receiver and says which staged version it may apply.

    Args:
        ctl: the receiver's control (cloned: one for the thread, one for ``update()``).
        group: the fleet group.
        watcher: the receiver's watcher (its id, its source, its condition).
        apply_lock: the receiver's; held while staging, so ``update()`` never reads a copy
            being written.
        verify: check the staged version against its published bucket checksums.
    """

    def __init__(self, ctl: Control, group: str, watcher: Watcher, apply_lock: threading.Lock, *, verify: bool) -> None:
        self.group = group
        self.staged: int | None = None  # complete in the private copy
        self.applied: int | None = None
        self.switches: tuple[FleetSwitch, ...] = ()  # the newest few, as last read
        self._ctl = ctl.clone()
        self._caller_ctl = ctl.clone()
        self._watcher = watcher
        self._apply_lock = apply_lock
        self._verify = verify
        self._ack: FleetAck | None = None
        self._lent = False
        self._complaints = Complaints(log, f"fleet member {watcher.name!r}")
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"wsync-fleet-r{watcher.rid}", daemon=True)
        self._thread.start()

    # -- update()'s side (under the receiver's apply lock) ------------------------------
    def take(self, held: int | None) -> int | None:
        """The staged version, when a switch naming this receiver holds it and it is above ``held``."""
        self._lent = False  # an apply target keeps the tensors it was handed until the next update()
        self._seen(self._read(self._caller_ctl, keys.fleet_switch(self.group), FleetSwitches))
        staged = self.staged
        if staged is None or (held is not None and staged <= held) or not self._switched(staged):
            return None
        return staged

    def did_apply(self, version: int, *, lent: bool) -> None:
        """``update()`` applied ``version``; ``lent``: an apply target holds the staged tensors,
        which are then not overwritten before the next ``update()``."""
        self.applied, self._lent = version, lent
        self._kick.set()  # no longer holding a switched version: say so now

    def wait_for_news(self, until: float) -> None:
        with self._watcher.cond:
            self._watcher.cond.wait(timeout=max(0.0, until - time.monotonic()))

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        self._thread.join(timeout=5)

    # -- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._kick.clear()
            try:
                self._step()
            except WeightSyncStoreError as exc:  # the watcher reports it
                log.debug("fleet member %r: %s", self._watcher.name, str(exc).strip()[:200])
                self._stop.wait(0.1)
            except Exception:  # noqa: BLE001 - the thread must outlive one bad step
                log.exception("fleet member %r: step failed; retrying", self._watcher.name)
                self._stop.wait(0.1)
            self._kick.wait(self._watcher.timing.fleet_poll_s)

    def _step(self) -> None:
        ctl = self._ctl
        # The round first: a round's switch is written before the next round opens, so a
        # round seen here comes with every switch before it.
        target = self._read(ctl, keys.fleet_round(self.group), FleetRound)
        self._seen(self._read(ctl, keys.fleet_switch(self.group), FleetSwitches))
        rid = self._watcher.rid
        with self._apply_lock:
            holding = self._holding()
            if target is not None and rid in target.rids and not holding and self.staged != target.version:
                self._stage(target)
        if self._watcher.source is None:  # not following the sender yet: not to be waited for
            seen = NOT_FOLLOWING
        else:
            seen = -1 if target is None else target.round
        ack = FleetAck(self.group, seen, _or(self.staged), holding)
        if ack != self._ack:
            ctl.put(keys.member_fleet(rid), ack)
            self._ack = ack

    def _holding(self) -> bool:
        """The staged copy is a switched version not applied yet: it must not be overwritten."""
        staged, applied = self.staged, self.applied
        if self._lent:
            return True
        return staged is not None and (applied is None or staged > applied) and self._switched(staged)

    def _switched(self, version: int) -> bool:
        rid = self._watcher.rid
        return any(s.version == version and rid in s.rids for s in self.switches)

    def _stage(self, target: FleetRound) -> None:
        source = self._watcher.source
        if source is None:
            return
        version = target.version
        sums: Callable[[int], list[int] | None] | None = None
        if self._verify:
            sums = (lambda v: list(target.sums) if v == version else None) if target.sums else self._sums
        exact = source.exact()
        before, self.staged = self.staged, None  # until the copy is complete
        try:
            if exact is not None:
                got = exact.apply_exactly(version, sums, self._watcher.on_rejected)
            else:  # a plane that cannot pick a version: the newest it has (it may be another)
                got = source.apply(before, sums, self._watcher.on_rejected)
        except WeightSyncIntegrityError as exc:
            log.warning("fleet member %r: staging version %d failed: %s", self._watcher.name, version, exc)
            return
        self.staged = before if got is None else got

    def _sums(self, version: int) -> list[int] | None:
        record = self._read(self._ctl, keys.version_sums(version), SumsRecord)
        return None if record is None or record.version != version else list(record.sums)

    def _seen(self, record: FleetSwitches | None) -> None:
        if record is None or record.switches == self.switches:
            return
        self.switches = record.switches
        with self._watcher.cond:
            self._watcher.cond.notify_all()

    def _read(self, ctl: Control, key: str, kind: type[R]) -> R | None:
        try:
            record = ctl.get_record(key, kind)
            self._complaints.good(key)
            return record
        except (WeightSyncRecordError, WeightSyncAuthError) as exc:
            self._complaints.bad(key, exc)
            return None


def _or(version: int | None) -> int:
    return -1 if version is None else version
