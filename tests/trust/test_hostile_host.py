"""Issue 32: what a relay host reads from the store's unsigned keys and from its leader's
directory is hostile input. A garbled leader heartbeat, odd files among the host-mates'
notes, a note for a receiver of another host, a note left pending across a stop, a garbled
shard note: each is reported once and skipped, and the thread that met it keeps serving.
On a real TCPStore in this process."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_wsync._control import keys
from lightning_wsync._control.checks import Complaints
from lightning_wsync._control.host import pid_namespace
from lightning_wsync._control.records import LeaderRecord, MemberRecord, MemberState
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import timing
from lightning_wsync._planes.relay.leader.elect import Election
from lightning_wsync._planes.relay.mate import notes as mates_module
from lightning_wsync._planes.relay.mate.board import Board, read_board
from lightning_wsync._planes.relay.mate.notes import MateDesk, MateRelay, Note, read_note
from lightning_wsync._planes.shard.send import ShardSendPlane
from lightning_wsync.errors import WeightSyncRecordError

pytestmark = pytest.mark.timeout(60)
PERIOD_S = 0.2
HOST = "host-a"


@pytest.fixture
def ctl(port: int) -> Iterator[Control]:
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield Control(store, "hostile", secret=b"s3cret")


def _register(ctl: Control, rid: int, *, host: str = HOST, pid: int | None = None) -> None:
    ctl.put(keys.member(rid), MemberRecord(f"r{rid}", host, os.getpid() if pid is None else pid, pid_namespace()))


@pytest.fixture
def leader(ctl: Control, tmp_path: Path) -> Iterator[tuple[Control, MateRelay]]:
    for rid in (0, 3, 4, 7):
        _register(ctl, rid)
    board = Board(str(tmp_path), PERIOD_S / 2, rid=0)
    relay = MateRelay(ctl, board, period_s=PERIOD_S, rid=0)
    yield ctl, relay
    relay.close()
    board.close()


def _passed(tmp_path: Path) -> dict[int, int]:
    posted = read_board(str(tmp_path))
    return {} if posted is None or posted.mates is None else posted.mates


def _until_passed_on(tmp_path: Path, rid: int, seq: int, timeout_s: float = 20) -> None:
    """Until the leader's board says it passed on note ``seq`` of ``rid``."""
    deadline = time.monotonic() + timeout_s
    while _passed(tmp_path).get(rid) != seq:
        assert time.monotonic() < deadline, f"note {seq} of rid {rid} not passed on within {timeout_s} s"
        time.sleep(0.01)


# -- finding 1: a garbled leader heartbeat --------------------------------------------------


def _lead(ctl: Control, election: Election, rid: int) -> None:
    """A leader record for ``rid`` in another PID namespace (judged by its heartbeat only)."""
    record = LeaderRecord(rid=rid, pid=1, term=0, shm="wsync-1-1-x", pidns=0, ready=True)
    ctl.set_text(election.key, ctl.seal(election.key, record.encode()))


def test_a_garbled_leader_heartbeat_is_reported_once_and_a_silent_leader_is_still_replaced(ctl, caplog) -> None:
    timeout_s = 0.5
    election = Election(epoch=1, host=HOST, rid=2, shm="wsync-2-1-x",
                        timing=timing(heartbeat_timeout_s=timeout_s, timeout_s=30.0))
    _lead(ctl, election, 1)
    ctl.set_text(keys.member_heartbeat(1), "²")  # str.isdigit() says yes, int() says no
    caplog.set_level(logging.WARNING)
    start = time.monotonic()
    while (record := election.elect(ctl)) is not None and record.rid == 1:
        assert time.monotonic() - start < timeout_s + 2.0, "the silent leader was not replaced"
        time.sleep(0.02)
    assert record is not None and record.rid == 2  # taken over within heartbeat_timeout_s (+ a poll)
    assert time.monotonic() - start >= timeout_s  # by its silence, not at the first garbled read
    said = [r for r in caplog.records if "member/1/hb" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_a_leader_whose_garbled_heartbeat_moves_again_is_kept(ctl) -> None:
    timeout_s = 0.4
    election = Election(epoch=1, host=HOST, rid=2, shm="wsync-2-1-x",
                        timing=timing(heartbeat_timeout_s=timeout_s, timeout_s=30.0))
    _lead(ctl, election, 1)
    ctl.set_text(keys.member_heartbeat(1), "not a number")
    end, beat = time.monotonic() + 3 * timeout_s, 0
    while time.monotonic() < end:
        record = election.elect(ctl)
        assert record is not None and record.rid == 1, "a beating leader was replaced"
        beat += 1
        ctl.set_text(keys.member_heartbeat(1), str(beat))  # the live leader puts its counter back
        time.sleep(0.02)


# -- finding 2: odd files among the host-mates' notes -----------------------------------------


def test_odd_files_among_the_notes_never_stop_the_thread_that_passes_beats_on(leader, tmp_path) -> None:
    ctl, relay = leader
    good = json.dumps(Note(3, 1, 30, None, os.getpid(), pid_namespace())._asdict())
    odd = {
        "²": good,  # a name str.isdigit() accepts and int() refuses
        "1" * 40: good,  # a rid beyond any integer the store would hold
        "11": "[" * 200_000,  # nested past the recursion limit
        "12": "\x00\xff garbage",
        "13": json.dumps({"rid": 13, "seq": "x"}),
        "14": json.dumps([1, 2, 3]),
    }
    for name, text in odd.items():
        with open(os.path.join(relay.directory, name), "w", encoding="utf-8") as f:
            f.write(text)
    os.mkfifo(os.path.join(relay.directory, "15"))  # open() would block forever
    os.symlink("/dev/zero", os.path.join(relay.directory, "16"))  # read() would never end
    os.mkdir(os.path.join(relay.directory, "17"))
    desk = MateDesk()
    for beat in range(1, 4):  # notes keep being passed on, with the odd files still there
        assert desk.write(str(tmp_path), 7, 70 + beat, None, time.monotonic())
        _until_passed_on(tmp_path, 7, beat)
        assert ctl.get_text(keys.member_heartbeat(7)) == str(70 + beat)
    assert relay._thread.is_alive()
    assert all(ctl.get_text(keys.member_heartbeat(rid)) is None for rid in (11, 12, 13, 14, 15, 16, 17))


def test_a_note_is_read_as_hostile_input(tmp_path) -> None:
    fifo, zero, deep = (str(tmp_path / name) for name in ("fifo", "zero", "deep"))
    os.mkfifo(fifo)
    os.symlink("/dev/zero", zero)
    with open(deep, "w") as f:
        f.write("{" * 100_000)
    done: list[object] = []
    reader = threading.Thread(target=lambda: done.extend(read_note(p) for p in (fifo, zero, deep)), daemon=True)
    reader.start()
    reader.join(10)
    assert done == [None, None, None]
    board_dir = tmp_path / "board_dir"
    board_dir.mkdir()
    os.symlink("/dev/zero", board_dir / "board")
    assert read_board(str(board_dir)) is None
    os.unlink(board_dir / "board")
    os.mkfifo(board_dir / "board")
    assert read_board(str(board_dir)) is None


# -- finding 3: whose note, and how old -----------------------------------------------------


def test_a_note_is_passed_on_only_for_a_member_of_this_host_with_its_own_pid(leader, tmp_path) -> None:
    ctl, relay = leader
    _register(ctl, 8, host="host-b")  # a receiver of another host
    _register(ctl, 9, pid=os.getppid())  # a member of this host, but the note names another process
    for rid in (8, 9, 10):  # 10: no member record at all
        assert MateDesk().write(str(tmp_path), rid, 100 + rid, None, time.monotonic())
    assert MateDesk().write(str(tmp_path), 7, 70, None, time.monotonic())
    _until_passed_on(tmp_path, 7, 1)
    time.sleep(3 * PERIOD_S)  # the others had as long and more: nothing of them is passed on
    assert [ctl.get_text(keys.member_heartbeat(rid)) for rid in (8, 9, 10)] == [None, None, None]
    assert set(_passed(tmp_path)) == {7}


def test_a_pending_note_older_than_its_freshness_is_dropped_at_flush(leader, tmp_path, monkeypatch) -> None:
    ctl, relay = leader
    relay.close()  # this test steps the leader itself: collected, then stopped, then resumed
    state = ctl.seal(keys.member_state(3), MemberState(5).encode())
    assert MateDesk().write(str(tmp_path), 3, 33, state, time.monotonic())
    relay._collect()
    # Stopped (SIGSTOP) for as long as the sender takes to retire the host-mate, then resumed:
    later = time.time() + 20 * PERIOD_S
    monkeypatch.setattr(mates_module.time, "time", lambda: later)
    relay._flush()
    assert ctl.get_text(keys.member_heartbeat(3)) is None and ctl.get_text(keys.member_state(3)) is None


def test_a_garbled_shard_note_is_reported_once_and_read_as_missing(ctl, caplog) -> None:
    plane = ShardSendPlane.__new__(ShardSendPlane)  # rank 0's view of one rank on another host
    plane._ctl, plane._ring, plane._timeout_s = ctl, None, 1.0
    plane._ranks, plane._others, plane._everyone_here = [], [], False
    plane._away = {1: keys.shard_written(1, 1)}
    plane._away_wrote, plane._away_read_at = {}, 0.0
    plane._complaints = Complaints(logging.getLogger("test"), "rank 0")
    caplog.set_level(logging.WARNING)
    ctl.set_text(keys.shard_written(1, 1), "²")
    for _ in range(3):
        plane._away_read_at = 0.0
        assert plane._missing_ranks(1) == [1]
    assert len([r for r in caplog.records if "wrote/1" in r.getMessage()]) == 1
    ctl.set_text(keys.shard_written(1, 1), "4")
    plane._away_read_at = 0.0
    assert plane._missing_ranks(3) == []


# -- every background thread: what it did not expect is reported, and it goes on ------------------


def test_the_notes_thread_reports_what_it_did_not_expect_and_goes_on(leader, tmp_path, caplog) -> None:
    ctl, relay = leader
    real, failures = relay._collect, [0]

    def failing() -> None:
        if failures[0] < 3:
            failures[0] += 1
            raise ZeroDivisionError("injected")
        real()

    relay._collect = failing  # type: ignore[method-assign]
    caplog.set_level(logging.DEBUG)
    desk, deadline, beat = MateDesk(), time.monotonic() + 20, 70
    while 7 not in _passed(tmp_path):  # a host-mate writes a note every half beat period
        assert time.monotonic() < deadline, "no note passed on after the thread's failures"
        beat += 1
        assert desk.write(str(tmp_path), 7, beat, None, time.monotonic())
        time.sleep(PERIOD_S / 2)
    assert failures[0] == 3 and relay._thread.is_alive() and ctl.get_text(keys.member_heartbeat(7)) is not None
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "injected" in r.getMessage()]
    assert len(errors) == 1 and errors[0].exc_info is not None  # with its traceback, once


def test_the_board_keeps_beating_through_what_it_did_not_expect(tmp_path, monkeypatch, caplog) -> None:
    from lightning_wsync._planes.relay.mate import board as board_module

    failures = [0]

    class _Os:  # the board module's os, whose utime fails unexpectedly twice
        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

        @staticmethod
        def utime(path: str) -> None:
            if failures[0] < 2:
                failures[0] += 1
                raise ZeroDivisionError("injected")
            os.utime(path)

    monkeypatch.setattr(board_module, "os", _Os())
    board = Board(str(tmp_path), 0.02, rid=0)
    try:
        os.utime(board.path, (time.time() - 60, time.time() - 60))
        deadline = time.monotonic() + 10
        while (posted := read_board(str(tmp_path))) is None or posted.age_s > 1:
            assert time.monotonic() < deadline, "the board stopped beating"
            time.sleep(0.01)
        assert failures[0] == 2 and board._thread.is_alive()
    finally:
        board.close()
    assert len([r for r in caplog.records if "injected" in r.getMessage() and r.levelno >= logging.ERROR]) == 1


# -- the rest of what the host and the unsigned keys hold -----------------------------------------


def _within(seconds: float, call: Callable[[], object]) -> object:
    """``call()``'s result, asserting it returns within ``seconds`` (a FIFO must not hang a reader)."""
    out: list[object] = []
    reader = threading.Thread(target=lambda: out.append(call()), daemon=True)
    reader.start()
    reader.join(seconds)
    assert out, f"still blocked after {seconds} s"
    return out[0]


def test_a_fifo_among_the_pins_or_as_the_cuda_handle_never_blocks_the_writer(tmp_path) -> None:
    from lightning_wsync._planes.shm.cuda_ipc import _FILE, open_mirror
    from lightning_wsync._planes.shm.pins import PinBoard

    os.mkfifo(tmp_path / "pin-1")
    os.symlink("/dev/zero", tmp_path / "pin-2")
    assert _within(10, lambda: PinBoard(str(tmp_path)).pinned(0, 1, 60.0)) is False
    os.mkfifo(tmp_path / _FILE)
    assert _within(10, lambda: open_mirror(str(tmp_path), torch.device("cpu"), "test")) is None


def test_a_ready_note_nested_past_the_recursion_limit_holds_nothing() -> None:
    from lightning_wsync._planes.delta.wire import parse_ready_note

    assert parse_ready_note("[" * 100_000) == (None, None)
    assert parse_ready_note('{"held": ["²", 1], "decode_s": null}') == (None, None)
    assert parse_ready_note("[1]") == (None, None)


def test_a_counter_garbled_while_it_is_bumped_never_costs_the_bumper_its_connection(ctl, port) -> None:
    """TCPStore drops a client whose ``add`` meets a non-integer: a ``bump`` raced by a store
    writer that garbles the key between a check and an ``add`` lost its connection for good."""
    writer = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    stop = threading.Event()

    def garble() -> None:
        while not stop.is_set():
            writer.set("wsync/hostile/news", "5")  # a check sees an integer ...
            writer.set("wsync/hostile/news", "not a number")  # ... and the add, maybe, this

    garbler = threading.Thread(target=garble, daemon=True)
    garbler.start()
    try:
        for _ in range(2000):
            ctl.bump(keys.NEWS)
    finally:
        stop.set()
        garbler.join(10)
    ctl.set_text(keys.NEWS, "41")
    ctl.bump(keys.NEWS)
    assert ctl.get_text(keys.NEWS) == "42"  # the same connection, still serving


def test_a_counter_garbled_while_it_is_added_to_never_costs_the_adder_its_connection(ctl, port) -> None:
    """``Control.add`` looked at the value and then called TCPStore's ``add``: a store writer
    that garbles the key in between made the server drop the adder's connection for good
    (every later call of that client failed). Now the add is a compare-and-set: a garbled
    counter is reported (WeightSyncRecordError) and the connection keeps serving."""
    writer = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    key = keys.MEMBERS_NEXT
    stop = threading.Event()

    def garble() -> None:
        while not stop.is_set():
            writer.set(f"wsync/hostile/{key}", "5")  # the check sees an integer ...
            writer.set(f"wsync/hostile/{key}", "not a number")  # ... and the add, maybe, this

    # Stored before the first add (the key absent, that add counts from 0: seen once at load 15,
    # the garbler thread not yet run): TCPStore answers this connection's get after its set.
    writer.set(f"wsync/hostile/{key}", "5")
    assert bytes(writer.get(f"wsync/hostile/{key}")) == b"5"
    garbler = threading.Thread(target=garble, daemon=True)
    garbler.start()
    added = refused = 0
    try:
        for _ in range(2000):
            try:
                assert ctl.add(key, 1) >= 6  # added to a "5" (or to its own 6, 7 ... before the garbler wrote)
                added += 1
            except WeightSyncRecordError:
                refused += 1
    finally:
        stop.set()
        garbler.join(10)
    assert added + refused == 2000 and refused > 0, (added, refused)
    ctl.set_text(key, "41")
    assert ctl.add(key, 1) == 42  # the same connection, still serving
    assert ctl.add(key, 0) == 42


def test_adders_racing_on_one_counter_each_get_a_number_of_their_own(ctl, port) -> None:
    """``add`` by compare-and-set: TCPStore answers with the value held afterwards, so two adders
    from the same count must still tell whose write won (receivers take their id this way)."""
    clients = [Control(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)), "hostile")
               for _ in range(4)]  # fmt: skip
    got: list[list[int]] = [[] for _ in clients]

    def adder(i: int) -> None:
        for _ in range(150):
            got[i].append(clients[i].add(keys.MEMBERS_NEXT, 1))

    threads = [threading.Thread(target=adder, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    numbers = sorted(n for mine in got for n in mine)
    assert numbers == list(range(1, 4 * 150 + 1))  # every number once: no two adders took the same
    assert ctl.get_text(keys.MEMBERS_NEXT) == "600"  # plain again: the tag is set back


def test_a_counter_with_adds_tag_reads_as_its_integer_and_nothing_else_does() -> None:
    from lightning_wsync._control.checks import parse_counter

    assert parse_counter("7 1f3a9c0e5b6d7e8f") == 7 and parse_counter(b"-3 00") == -3
    for bad in ("7 ", "7 xyz", "7 1F", " 7", "7  1f", "7 " + "a" * 33, "\u00b2 1f", "1e9"):
        assert parse_counter(bad) is None, bad


def test_a_leader_in_no_chain_hears_of_a_new_sender_within_a_beat_period(ctl) -> None:
    """A leader elected after its sender died is in no chain; the next sender rings the old
    chain's leaders, not it, so it heard of the new sender only at its bell's backstop (30 s;
    the full chaos run's 12.75 s catch-up). Now a leader in no chain also looks at ``news``
    each beat period and rings its own bell (its watcher then reads the news) when it moved."""
    from lightning_wsync._planes.relay.leader.bell import Bell

    beat = timing(heartbeat_timeout_s=0.8, timeout_s=10.0)  # hosted_beat_s = 0.5 s
    _register(ctl, 2)
    election = Election(epoch=1, host=HOST, rid=2, shm="wsync-2-1-x", timing=beat)
    assert election.elect(ctl) is not None  # it leads; there is no chain
    bell = Bell(ctl, election, epoch=1, rid=2, timing=beat)
    reads = threading.Event()
    bell.listen(reads.set)

    def read_within(within_s: float) -> bool:
        """Ask what the leader's loop asks while in no chain until the bell's thread has read again."""
        reads.clear()
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            bell.current(-1)
            if reads.wait(0.05):
                return True
        return False

    try:
        assert read_within(4 * beat.hosted_beat_s), "the first look (news never read) did not ring the bell"
        assert not read_within(2 * beat.hosted_beat_s), "the bell rang with nothing moved"
        ctl.bump(keys.NEWS)  # a new sender started (it rings the old chain's leaders only)
        assert read_within(4 * beat.hosted_beat_s), "the bell was not rung within four beat periods of the news"
    finally:
        bell.close()
