"""The pieces of a relay leader's writes for its host-mates (:mod:`lightning_wsync._planes.relay.mate.notes`),
on a real TCPStore in this process: what the leader passes on, and when a host-mate keeps to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_wsync._control import keys
from lightning_wsync._control.host import pid_namespace
from lightning_wsync._control.records import MemberRecord, MemberState
from lightning_wsync._control.store import Control
from lightning_wsync._planes.relay.mate.board import Board, HostNews, Posted, read_board
from lightning_wsync._planes.relay.mate.notes import MATES, MateDesk, MateRelay, Note
from lightning_wsync.testing.stores import host_store

pytestmark = pytest.mark.timeout(60)
PERIOD_S = 0.2


def _wait(what: str, condition: Callable[[], Any], timeout_s: float = 20) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.01)
    return result


@pytest.fixture
def leader(tmp_path: Path, port: int) -> Iterator[tuple[Control, Board, MateRelay]]:
    store = host_store("127.0.0.1", port, timeout_s=10)
    ctl = Control(store, "mates", secret=b"s3cret")
    for rid in range(8):  # the leader passes on notes of its own host's members only
        ctl.put(keys.member(rid), MemberRecord(f"r{rid}", "host", os.getpid(), pid_namespace()))
    board = Board(str(tmp_path), PERIOD_S / 2, rid=0)
    relay = MateRelay(ctl, board, period_s=PERIOD_S, rid=0)
    yield ctl, board, relay
    relay.close()
    board.close()


def _passed(tmp_path: Path) -> dict[int, int]:
    posted = read_board(str(tmp_path))
    return {} if posted is None or posted.mates is None else posted.mates


def test_notes_are_passed_on_in_one_write_and_the_board_says_so(leader, tmp_path) -> None:
    ctl, _, relay = leader
    desks = {rid: MateDesk() for rid in (3, 4)}
    states = {rid: ctl.seal(keys.member_state(rid), MemberState(7).encode()) for rid in desks}
    for rid, desk in desks.items():
        assert desk.write(str(tmp_path), rid, 10 + rid, states[rid], time.monotonic())
    _wait("both notes passed on", lambda: _passed(tmp_path) == {3: 1, 4: 1})
    for rid in desks:
        assert ctl.get_text(keys.member_heartbeat(rid)) == str(10 + rid)
        assert ctl.decode(keys.member_state(rid), ctl.get_text(keys.member_state(rid)) or "", MemberState).acked == 7
    assert sorted(os.listdir(relay.directory)) == ["3", "4"]  # no note left half-written
    assert desks[3].leave()  # back to the store: its note goes, and the board forgets it
    assert desks[4].write(str(tmp_path), 4, 20, states[4], time.monotonic())
    _wait("rid 4's next note passed on, rid 3 forgotten", lambda: _passed(tmp_path) == {4: 2})
    assert ctl.get_text(keys.member_heartbeat(4)) == "20"


def test_notes_of_dead_or_stalled_writers_are_not_passed_on(leader, tmp_path) -> None:
    ctl, _, relay = leader
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its PID names no process
    with open(os.path.join(relay.directory, "5"), "w") as f:
        json.dump(Note(5, 1, 50, None, dead.pid, pid_namespace())._asdict(), f)
    stale = os.path.join(relay.directory, "6")
    with open(stale, "w") as f:
        json.dump(Note(6, 1, 60, None, os.getpid(), pid_namespace())._asdict(), f)
    os.utime(stale, (time.time() - 10 * PERIOD_S, time.time() - 10 * PERIOD_S))  # written long ago
    assert MateDesk().write(str(tmp_path), 7, 70, None, time.monotonic())
    _wait("the live note passed on", lambda: _passed(tmp_path) == {7: 1})
    assert ctl.get_text(keys.member_heartbeat(5)) is None and ctl.get_text(keys.member_heartbeat(6)) is None


def test_a_host_mate_keeps_to_its_leader_only_while_its_notes_are_passed_on(tmp_path) -> None:
    desk, period, start = MateDesk(), 1.0, time.monotonic()
    board = Posted(HostNews(None, None), age_s=0.1, directory=str(tmp_path), mates={})
    assert not desk.keeps(board, 3, start, period)  # no beat of its own on the store yet
    desk.confirm(start)
    assert not desk.keeps(board._replace(mates=None), 3, start, period)  # a leader that passes nothing on
    assert not desk.keeps(board._replace(age_s=2 * period), 3, start, period)  # a leader silent on the host
    assert desk.keeps(board, 3, start + 2 * period, period)
    assert not desk.keeps(board, 3, start + 3 * period, period)  # nothing of it on the store for 3 periods
    os.makedirs(tmp_path / MATES)
    written = time.monotonic()
    assert desk.write(str(tmp_path), 3, 1, None, written)
    passed = board._replace(mates={3: 1})
    assert desk.keeps(passed, 3, written + 2 * period, period)  # passed on: counted from when it was written
    assert not desk.keeps(passed, 3, written + 3 * period, period)  # and nothing newer since
    # Passed on long after it was written (this process was stopped meanwhile, and the sender
    # may have forgotten it): it vouches for nothing newer than its writing.
    written = time.monotonic()
    assert desk.write(str(tmp_path), 3, 2, None, written)
    assert not desk.keeps(board._replace(mates={3: 2}), 3, written + 10 * period, period)
    assert desk.leave() and not (tmp_path / MATES / "3").exists() and not desk.leave()
    # Decided before a stall of this process (a second ago): refused, and taken back by leaving.
    assert not desk.write(str(tmp_path), 3, 3, None, time.monotonic() - 1)
    assert desk.leave() and not (tmp_path / MATES / "3").exists()
