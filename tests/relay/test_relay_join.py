"""Joining and leaving a relay hop: a side that leaves never strands its peer (in the group's
set-up, or in a receive from it).

Both sides of each test are threads of this process on a real TCPStore with real gloo
groups (``make_group`` releases the GIL while it waits for its peer). The race under test
is made deterministic by the leaving side's ``abandon()``: the peer is started only once
this side has looked for it and not found it, and ``abandon()`` answers only after the peer
has acted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_wsync._control import keys
from lightning_wsync._control.store import Control
from lightning_wsync._planes.relay.hops import GONE, JOINING, TAKEN, Superseded, join_hop
from lightning_wsync._planes.wire import Interruptible, PeerGroup, close_group, shutdown_group
from lightning_wsync.testing.stores import host_store

PREFIX = keys.relay_hop_prefix(1, 7, 3)
TIMEOUT_S = 6.0


def wait_for(what: str, condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.002)


class Peer:
    """Side 1 of the hop, joining in a thread: what it got and how long it took."""

    def __init__(self, ctl: Control, timeout_s: float) -> None:
        self.pg: PeerGroup | None = None
        self.error: BaseException | None = None
        self.took_s = -1.0
        self._thread = threading.Thread(target=self._join, args=(ctl, timeout_s), name="test-hop-peer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _join(self, ctl: Control, timeout_s: float) -> None:
        started = time.monotonic()
        try:
            self.pg = join_hop(ctl, PREFIX, 1, "gloo", "127.0.0.1", timeout_s, lambda: False)
        except BaseException as exc:  # noqa: BLE001 - judged by the test
            self.error = exc
        self.took_s = time.monotonic() - started

    def join(self) -> None:
        self._thread.join(timeout=2 * TIMEOUT_S)
        assert not self._thread.is_alive()


@pytest.fixture
def ctls(port: int) -> tuple[Control, Control]:
    server = host_store("127.0.0.1", port, timeout_s=30)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    return Control(server, "join"), Control(client, "join")


@pytest.mark.timeout(60)
def test_a_side_leaving_after_its_peer_committed_builds_the_group_so_the_peer_is_not_held(ctls) -> None:
    """Before: the leaving side raised Superseded and the peer, which had seen its mark,
    waited in the group's set-up for the whole timeout_s."""
    mine, theirs = ctls
    peer = Peer(theirs, TIMEOUT_S)

    def abandon() -> bool:  # called once this side found no peer: the peer comes now, and commits
        if not peer._thread.is_alive() and peer.took_s < 0:
            peer.start()
        in_setup = keys.group_keys(PREFIX)[1]  # gloo's address key of side 1: it is building the group
        wait_for("the peer to start building the group", lambda: mine.has(in_setup))
        return True

    pg = join_hop(mine, PREFIX, 0, "gloo", "127.0.0.1", TIMEOUT_S, abandon)  # the peer committed: no Superseded
    peer.join()
    try:
        assert peer.error is None and peer.pg is not None, peer.error
        assert peer.took_s < TIMEOUT_S / 2, peer.took_s
        sent = torch.arange(1000, dtype=torch.int64)
        got = torch.zeros(1000, dtype=torch.int64)
        work = peer.pg.recv([got], 0, 0)
        pg.send([sent], 1, 0).wait()
        work.wait()
        assert torch.equal(got, sent)  # a working group on both sides
    finally:
        shutdown_group(pg)
        shutdown_group(peer.pg)


@pytest.mark.timeout(60)
def test_a_side_that_leaves_first_withdraws_and_a_late_peer_does_not_commit_to_it(ctls) -> None:
    mine, theirs = ctls
    with pytest.raises(Superseded):
        join_hop(mine, PREFIX, 0, "gloo", "127.0.0.1", TIMEOUT_S, lambda: True)
    assert mine.get_text(keys.joined(PREFIX, 0)) == GONE
    peer = Peer(theirs, 0.5)
    peer.start()
    peer.join()
    assert isinstance(peer.error, TimeoutError) and peer.pg is None, peer.error
    assert peer.took_s < TIMEOUT_S / 2, peer.took_s  # left at its own bound, not held in a group's set-up
    assert theirs.get_text(keys.joined(PREFIX, 1)) == GONE
    assert mine.get_text(keys.joined(PREFIX, 0)) == GONE  # never taken


@pytest.mark.timeout(60)
def test_both_sides_joining_commit_to_one_group(ctls) -> None:
    mine, theirs = ctls
    peer = Peer(theirs, TIMEOUT_S)
    peer.start()
    pg = join_hop(mine, PREFIX, 0, "gloo", "127.0.0.1", TIMEOUT_S, lambda: False)
    peer.join()
    try:
        assert peer.error is None and peer.pg is not None, peer.error
        assert {mine.get_text(keys.joined(PREFIX, r)) for r in (0, 1)} <= {TAKEN, JOINING}
        assert TAKEN in {mine.get_text(keys.joined(PREFIX, r)) for r in (0, 1)}
    finally:
        shutdown_group(pg)
        shutdown_group(peer.pg)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("interruptible", [False, True])
def test_leaving_a_hop_ends_the_peers_wait_at_once_even_with_a_send_still_referenced(ctls, interruptible) -> None:
    """An aborted gloo group keeps its connection open while one of its works is referenced
    (here a send the peer never matches, as a leader's unfinished forward), so a peer blocked
    in a receive from it waited for the group timeout (measured: the whole timeout_s);
    ``close_group`` closes the connection."""
    mine, theirs = ctls
    peer = Peer(theirs, TIMEOUT_S)
    peer.start()
    raw = join_hop(mine, PREFIX, 0, "gloo", "127.0.0.1", TIMEOUT_S, lambda: False)
    peer.join()
    assert peer.pg is not None, peer.error
    pg: PeerGroup = Interruptible(raw, "gloo") if interruptible else raw
    waited: dict[str, object] = {}

    posted = peer.pg.recv([torch.zeros(1 << 16, dtype=torch.uint8)], 0, 0)  # never matched by a send

    def receive() -> None:
        started = time.monotonic()
        try:
            posted.wait()
            waited["error"] = None
        except RuntimeError as exc:
            waited["error"] = str(exc)
        waited["s"] = time.monotonic() - started

    receiver = threading.Thread(target=receive, name="test-hop-receive", daemon=True)
    receiver.start()
    pending = pg.send([torch.ones(1 << 16, dtype=torch.uint8)], 1, 5)  # noqa: F841 - kept alive on purpose
    close_group(pg, 1, "gloo")
    receiver.join(timeout=2 * TIMEOUT_S)
    shutdown_group(peer.pg)
    # gloo reports the peer's close as "Connection closed by peer" or, when the close races its
    # own read, "Connection reset": either way the wait ended because the peer left.
    error = str(waited["error"]).lower()
    assert waited["error"] is not None and ("closed" in error or "connection reset" in error), waited
    assert float(waited["s"]) < TIMEOUT_S / 2, waited  # type: ignore[arg-type]

