"""A relay host's leader beats and acknowledges for its host-mates (issue 22).

A host-mate that reads its leader's ring, and whose leader's board is fresh and says it
passes notes on, writes no heartbeat and no acknowledgement to the store. It leaves a
*note* in the leader's pin directory instead (``mates/<rid>``, replaced atomically): its
heartbeat count and its ``member/<rid>/state`` record, sealed by the host-mate itself (the
leader passes on bytes it could not forge). The leader's :class:`MateRelay` looks at the
notes every ``COLLECT_S`` (a directory listing: free for the store) and writes every fresh
one's heartbeat and state in one ``multi_set``: at once when a state changed (a push report
waits for it), else once every ``period_s``. Its board then says which note of each
host-mate it passed on.

What keeps the sender's judgement true:

- A note is passed on only when it changed and is younger than ``fresh_s``, and not when
  its writer's PID is gone (same PID namespace): a dead host-mate's heartbeat stops, as
  before, and a note left behind by a host-mate that moved on (to the store, another
  leader, a new rid) is never passed on later.
- A host-mate (:class:`MateDesk`) keeps to its leader only while its notes are passed on:
  when the newest note passed on was written more than two beat periods ago (leader
  stalled, killed, stepping down; or this process itself stalled, which the write time
  tells, whatever the board says on waking) it removes its note and beats on the store
  itself, where the compare-and-set also tells it that the sender deleted its keys (it
  registers again). So a leader never re-creates keys the sender deleted.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from typing import NamedTuple

from lightning_wsync._control import keys
from lightning_wsync._control.checks import Complaints
from lightning_wsync._control.host import pid_alive, pid_namespace
from lightning_wsync._control.records import MemberRecord
from lightning_wsync._control.store import Control
from lightning_wsync._control.untrusted import Untrusted, counter, load_json, read_file, unexpected
from lightning_wsync._planes.relay.mate.board import Board, Posted
from lightning_wsync.errors import WeightSyncAuthError, WeightSyncError, WeightSyncRecordError

log = logging.getLogger(__name__)

MATES = "mates"  # the notes' directory, in the leader's pin directory
COLLECT_S = 0.02  # the leader looks at its host-mates' notes this often (a listing; no request)
LINGER_S = 0.05  # a new acknowledgement waits this long for its host-mates' (one write for them all)
_SLACK_S = 0.2
_PIDNS = pid_namespace()


class Note(NamedTuple):
    """What a host-mate asks its leader to write for it."""

    rid: int
    seq: int  # this host-mate's note count: the board says which was passed on
    beat: int  # its heartbeat count (``member/<rid>/hb``)
    state: str | None  # its ``member/<rid>/state`` record, sealed (None: not yet)
    pid: int
    pidns: int


def read_note(path: str) -> Note | None:
    """The note at ``path``, or None for anything else (read as hostile input: see
    :func:`~lightning_wsync._control.untrusted.read_file`)."""
    try:
        value = load_json(read_file(path)[0], path)
        if not isinstance(value, dict):
            return None
        note = Note(**value)
    except (OSError, ValueError, TypeError):  # Untrusted is a ValueError
        return None
    ints = (note.rid, note.seq, note.beat, note.pid, note.pidns)
    good = all(isinstance(v, int) for v in ints) and (note.state is None or isinstance(note.state, str))
    return note if good else None


class MateRelay:
    """The leader's end: passes its host-mates' notes to the store on a thread of its own.

    Args:
        control: the leader's control (the thread uses a clone of it).
        board: the leader's board, where it says what it passed on.
        period_s: beats are written at most this often (a quarter of ``heartbeat_timeout_s``).
    """

    def __init__(self, control: Control, board: Board, *, period_s: float, rid: int) -> None:
        self.directory = os.path.join(os.path.dirname(board.path), MATES)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._board = board
        self._period_s = period_s
        self._fresh_s = period_s  # host-mates write a note every half beat period
        self._ctl = control.clone()
        self._seen: dict[int, tuple[int, int]] = {}  # rid -> (inode, mtime) of the note last read
        self._pending: dict[int, tuple[Note, float]] = {}  # rid -> the note to pass on, and when written
        self._rid = rid
        self._host: str | None = None  # this leader's host, as its own member record says
        self._members: dict[int, tuple[int, int] | None] = {}  # rid -> (pid, pidns) of a member of this host
        self._asked: dict[int, float] = {}  # rid -> when its member record may be read again
        self._complaints = Complaints(log, f"relay: leader rid={rid}'s host-mates' notes")
        self._sent: dict[int, Note] = {}  # rid -> the note last passed on
        self._due = 0.0
        self._acks_since: float | None = None  # when the oldest acknowledgement not yet passed on came
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"wsync-relay-mates-r{rid}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(COLLECT_S):
            try:
                self._step(time.monotonic())
            except FileNotFoundError:
                return  # the pin directory is gone with the segment (stepping down)
            except (OSError, WeightSyncError) as exc:  # the store's boundary, or the host's
                log.debug("relay: host-mates' notes not passed on: %s", exc)
                self._stop.wait(self._period_s / 4)
            except Exception as exc:  # noqa: BLE001 - host-mates would fall back to the store, unsaid
                unexpected(log, self._thread.name, exc)
                self._stop.wait(self._period_s / 4)

    def _step(self, now: float) -> None:
        self._collect()
        acks = {rid for rid, (note, _) in self._pending.items() if self._new_state(rid, note)}
        if acks and self._acks_since is None:
            self._acks_since = now
        # A push report may be waiting for an acknowledgement: it goes at once when every writer
        # known here has one (a version reached the whole host), else after LINGER_S.
        everyone = bool(acks) and acks >= set(self._sent) | set(self._pending)
        lingered = self._acks_since is not None and now - self._acks_since >= LINGER_S
        if self._pending and (everyone or lingered or now >= self._due):
            self._flush()
            self._due, self._acks_since = now + self._period_s, None

    def _collect(self) -> None:
        present: set[int] = set()
        for name in os.listdir(self.directory):
            if name.startswith("."):
                continue  # a note being written (".<rid>.<pid>")
            try:
                rid = counter(name, f"{self.directory}/{name!r}")
                if rid < 0 or str(rid) != name:
                    raise Untrusted(f"{self.directory}/{name!r} is not a note's name")
            except Untrusted as exc:  # another process of this user wrote it: said once, skipped
                self._complaints.bad(name, exc)
                continue
            path = os.path.join(self.directory, name)
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(info.st_mode):
                self._complaints.bad(name, Untrusted(f"{path} is not a regular file"))
                continue
            present.add(rid)
            if self._seen.get(rid) == (info.st_ino, info.st_mtime_ns):
                continue
            self._seen[rid] = (info.st_ino, info.st_mtime_ns)
            if time.time() - info.st_mtime > self._fresh_s:
                continue  # left behind: its writer stalled or moved on
            note = read_note(path)
            sent = self._sent.get(rid)
            if note is None or note.rid != rid or (sent is not None and note.seq <= sent.seq):
                continue
            if note.pidns == _PIDNS and not pid_alive(note.pid):
                continue
            if not self._member_here(note):
                continue  # written for a receiver of another host, or by another process than the member's
            self._pending[rid] = (note, info.st_mtime)
        for rid in set(self._seen) - present:  # removed: its host-mate beats elsewhere now
            self._seen.pop(rid)
            self._sent.pop(rid, None)
            self._pending.pop(rid, None)
            self._members.pop(rid, None)
            self._asked.pop(rid, None)

    def _member_here(self, note: Note) -> bool:
        """Whether ``note`` comes from a member of this host: its signed ``member/<rid>`` record
        names this leader's host and the note's writer (read once per rid, again at most once a
        beat period while a note disagrees)."""
        known = self._members.get(note.rid)
        now = time.monotonic()
        if known != (note.pid, note.pidns) and now >= self._asked.get(note.rid, 0.0):
            self._asked[note.rid] = now + self._period_s
            known = self._members[note.rid] = self._member(note.rid)
        return known == (note.pid, note.pidns)

    def _member(self, rid: int) -> tuple[int, int] | None:
        key = keys.member(rid)
        try:
            if self._host is None:
                mine = self._ctl.get_record(keys.member(self._rid), MemberRecord)
                self._host = None if mine is None else mine.host
            record = self._ctl.get_record(key, MemberRecord)
        except (WeightSyncRecordError, WeightSyncAuthError) as exc:
            self._complaints.bad(key, exc)
            return None
        if record is None or self._host is None or record.host != self._host:
            return None
        return record.pid, record.pidns

    def _new_state(self, rid: int, note: Note) -> bool:
        sent = self._sent.get(rid)
        return note.state is not None and (sent is None or note.state != sent.state)

    def _flush(self) -> None:
        # A note waits here at most a beat period after it was collected fresh; one older than that
        # (this leader was stopped, or slow) may be from a host-mate the sender has retired since
        # (heartbeat_timeout_s is four beat periods): its keys must not come back.
        oldest = time.time() - self._fresh_s - self._period_s
        self._pending = {rid: (note, at) for rid, (note, at) in self._pending.items() if at >= oldest}
        values: dict[str, str] = {}
        for rid, (note, _) in self._pending.items():
            sent = self._sent.get(rid)
            if sent is None or note.beat != sent.beat:
                values[keys.member_heartbeat(rid)] = str(note.beat)
            if note.state is not None and self._new_state(rid, note):
                values[keys.member_state(rid)] = note.state
        self._ctl.multi_set(values)
        self._sent.update({rid: note for rid, (note, _) in self._pending.items()})
        self._pending.clear()
        self._board.passed_on({rid: note.seq for rid, note in self._sent.items()})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class MateDesk:
    """A host-mate's end: whether to beat and acknowledge through its leader, and its notes."""

    def __init__(self) -> None:
        self._file: str | None = None  # the note last written (None: on the store)
        self._seq = 0
        self._passed = 0  # the newest of its notes the leader says it passed on
        self._written: dict[int, float] = {}  # seq -> when written, for notes not known to be passed on
        self._confirmed_at = 0.0  # when this receiver wrote the newest beat known to be on the store

    def confirm(self, now: float) -> None:
        """A beat was written to the store by this receiver itself."""
        self._confirmed_at = now

    def keeps(self, posted: Posted | None, rid: int, now: float, period_s: float) -> bool:
        """Whether to beat and acknowledge through the leader whose board is ``posted`` now."""
        if posted is None or posted.mates is None or posted.age_s > period_s:
            return False
        passed = posted.mates.get(rid, 0)
        if self._file is not None and passed > self._passed:
            self._passed = passed
            self._confirmed_at = max(self._confirmed_at, self._written.get(passed, 0.0))
            self._written = {seq: at for seq, at in self._written.items() if seq > passed}
        # The leader writes every period_s what was written in the half period before: the
        # newest note passed on is at most 1.5 periods old just before its next write.
        return now - self._confirmed_at <= 2 * period_s + _SLACK_S

    def write(self, directory: str, rid: int, beat: int, state: str | None, now: float) -> bool:
        """Leave a note for the leader whose pin directory is ``directory``, as decided at ``now``.

        False when it cannot, or when this process stalled since ``now`` (the sender may have
        forgotten it meanwhile): the caller then :meth:`leave` s, which takes the note back.
        """
        path = os.path.join(directory, MATES, str(rid))
        if self._file is not None and self._file != path:
            self.leave()  # another leader, or a new rid
        self._file = path
        self._seq += 1
        note = Note(rid, self._seq, beat, state, os.getpid(), _PIDNS)
        tmp = os.path.join(directory, MATES, f".{rid}.{os.getpid()}")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(note._asdict(), f)
            os.replace(tmp, path)
        except OSError as exc:
            log.debug("relay: note %s not written: %s", path, exc)
            return False
        if time.monotonic() - now > _SLACK_S:
            return False
        self._written[self._seq] = now
        return True

    def leave(self) -> bool:
        """Beat on the store from now on: remove the note. Returns whether there was one (the
        store may then hold an older beat of this receiver, or miss its newest state)."""
        path, self._file = self._file, None
        self._written.clear()
        if path is None:
            return False
        try:
            os.unlink(path)
        except OSError:
            pass
        return True
