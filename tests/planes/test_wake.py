"""The readers' wake-up socket (``_planes/shm/wake.py``): a ring closed by one thread while
another waits on it (a relay host's member thread switching to a new leader's ring under a
receiver's ``wait_for_version``) must end the wait, not raise out of the user's call. Seen
in the relay chaos test: ``select`` on the closed socket raised EBADF and the receiver
process exited."""

from __future__ import annotations

import os
import time

from lightning_wsync._planes.shm.wake import Waker, WakeSocket, wait_any


def test_a_wake_up_ends_the_wait(tmp_path):
    sock = WakeSocket.bind(str(tmp_path))
    assert sock is not None
    Waker(str(tmp_path)).wake()
    started = time.monotonic()
    sock.wait(30)
    assert time.monotonic() - started < 10
    sock.close()


def test_a_socket_closed_under_the_waiter_returns_instead_of_raising(tmp_path):
    sock = WakeSocket.bind(str(tmp_path))
    assert sock is not None
    sock.close()  # fileno() is -1 now: select() raises ValueError
    sock.wait(30)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("wake-")]


def test_a_descriptor_closed_between_fileno_and_select_returns_instead_of_raising(tmp_path):
    sock = WakeSocket.bind(str(tmp_path))
    assert sock is not None
    os.close(sock._sock.fileno())  # the race's other end: the object still names a closed descriptor (EBADF)
    started = time.monotonic()
    sock.wait(30)
    assert time.monotonic() - started < 10
    sock._sock.detach()  # the descriptor is gone already


def test_a_wake_up_of_any_of_several_sockets_ends_the_wait_and_each_is_drained(tmp_path):
    """A receiver of a sharded push waits on every trainer rank's ring at once (``wait_any``): the
    second ring's writer waking it ends the wait, and what was queued is drained."""
    dirs = [tmp_path / "rank0", tmp_path / "rank1"]
    socks = []
    for d in dirs:
        d.mkdir()
        sock = WakeSocket.bind(str(d))
        assert sock is not None
        socks.append(sock)
    Waker(str(dirs[1])).wake()
    started = time.monotonic()
    wait_any(socks, 30)
    assert time.monotonic() - started < 10
    started = time.monotonic()
    wait_any(socks, 0.05)  # nothing left queued: this one times out
    assert time.monotonic() - started >= 0.04
    for sock in socks:
        sock.close()
