"""A receiver's heartbeat counter and acknowledgements: written to the store, or left as notes
for its relay host's leader while that leader's board keeps them
(:class:`~lightning_wsync._planes.base.MateNotes`)."""

from __future__ import annotations

from collections.abc import Callable

from lightning_wsync._control import keys
from lightning_wsync._control.checks import Complaints, parse_counter
from lightning_wsync._control.member_state import StateReport
from lightning_wsync._control.store import Control
from lightning_wsync._planes.base import Posted
from lightning_wsync._planes.open import open_mate_notes
from lightning_wsync.errors import WeightSyncRecordError


class Heartbeat:
    """One receiver's beats (its counter's last value: :attr:`count`) and state reports."""

    def __init__(self, report: StateReport, complaints: Complaints) -> None:
        self.count = 0  # the heartbeat counter's last value
        self._report = report
        self._complaints = complaints
        self._notes = open_mate_notes()  # a relay host-mate beats and acknowledges through its leader

    def leave(self) -> bool:
        """Beat on the store from now on; whether a note was taken back (the store may lag)."""
        return self._notes.leave()

    def tick(
        self, ctl: Control, rid: int, now: float, next_beat: float, posted: Posted | None, period: float,
        rejoin: Callable[[Control], None],
    ) -> float:
        """Beat when due (every ``period``) and acknowledge what changed; returns when to beat next;
        ``rejoin``: the sender forgot this receiver (its counter restarted).

        A relay host-mate whose leader passes notes on hands both to it (no request, and a
        beat every half period, so that each of the leader's writes has a new one); anyone
        else, and a host-mate whose notes stopped being passed on, writes them to the store.
        """
        if posted is not None and self._notes.keeps(posted, rid, now, period):
            due = now >= next_beat
            state = self._report.take(ctl)
            if not due and state is None:
                return next_beat
            if self._notes.write(posted.directory, rid, self.count + due, self._report.sealed, now):
                self.count += due
                return now + period / 2 if due else next_beat
        lagging = self._notes.leave()  # the store may hold an older beat, and lack the newest state
        if now >= next_beat or lagging:
            beat = self.once(ctl, rid, lagging=lagging)
            if beat <= self.count:  # the counter restarted: the sender deleted this receiver's keys
                rejoin(ctl)
            self.count = beat
            next_beat = now + period
            self._notes.confirm(now)
        self._report.write(ctl, force=lagging)
        return next_beat

    def once(self, ctl: Control, rid: int, *, lagging: bool = False) -> int:
        key = keys.member_heartbeat(rid)
        beat = str(self.count + 1)
        # One request while the counter holds this receiver's last beat; anything else (deleted
        # by the sender, garbled) takes the checked path below.
        if self.count > 0:
            held = ctl.compare_set(key, str(self.count), beat)
            if held == beat.encode():
                return self.count + 1
            # Back from its leader, which may not have written its last beats: an older one of its
            # own is no restart (an absent key reads as the expected value: that one is).
            seen = parse_counter(held)
            if lagging and seen is not None and seen < self.count:
                if ctl.compare_set(key, str(seen), beat) == beat.encode():
                    return self.count + 1
        try:
            return ctl.add(key, 1)
        except WeightSyncRecordError as exc:  # garbled by someone else: this receiver owns it, so restore it
            self._complaints.bad(key, exc)
            ctl.set_text(key, str(self.count + 1))
            return self.count + 1
