"""The readers' wake-up socket (``_planes/shm/wake.py``): a ring closed by one thread while
another waits on it (a relay host's member thread switching to a new leader's ring under a
receiver's ``wait_for_version``) must end the wait, not raise out of the user's call. Seen
in the relay chaos test: ``select`` on the closed socket raised EBADF and the receiver
process exited."""

from __future__ import annotations

import os
import time

from lightning_wsync._planes.shm.wake import Waker, WakeSocket


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
