"""Waking the readers of a shared-memory ring when a version lands, instead of their polling.

Each reader binds a datagram socket in the segment's pin directory (``wake-*``); after
every published version the writer sends one byte to each of them. A reader waits on its
socket with a timeout and still reads the ring's header after every wake-up or timeout, so
a lost or refused datagram costs at most one timeout, never a version. At 8 simulated
hosts × 2 receivers, readers polling the header every 5 ms were ~5% of the machine's CPU
during a push and their wake-up lag was part of every push's latency.

A path-named socket is found through the file system, so the writer reaches readers in
other network namespaces of the same host (which share ``/dev/shm``). Where a socket
cannot be bound (a path over the 107 bytes of ``sun_path``, a read-only directory), the
reader polls the header instead.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
from collections.abc import Sequence

log = logging.getLogger(__name__)

PREFIX = "wake-"
_ids = itertools.count()


class WakeSocket:
    """A reader's end: :meth:`wait` returns when the writer wakes it, or after ``timeout_s``."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self._sock = sock
        self._path = path

    @classmethod
    def bind(cls, directory: str) -> WakeSocket | None:
        """A socket in ``directory``; None where none can be bound (the caller polls)."""
        path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{next(_ids)}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(path)
        except OSError as exc:
            sock.close()
            log.debug("no wake-up socket at %s (%s): polling the ring header", path, exc)
            return None
        sock.setblocking(False)
        return cls(sock, path)

    def wait(self, timeout_s: float) -> None:
        """Until a wake-up or ``timeout_s``; at once when the socket was closed meanwhile
        (another thread closing the ring under a waiter): the caller reads the header again."""
        wait_any([self], timeout_s)

    def _drain(self) -> None:
        while True:  # several versions may have landed: one look at the header covers them
            try:
                self._sock.recv(16)
            except OSError:  # BlockingIOError once the queue is drained
                return

    def close(self) -> None:
        self._sock.close()
        try:
            os.unlink(self._path)
        except OSError:
            pass


def wait_any(sockets: Sequence[WakeSocket], timeout_s: float) -> None:
    """Until any of ``sockets`` is woken, or ``timeout_s`` (a reader of several rings: each ring's
    writer wakes its own readers); at once when one was closed meanwhile."""
    try:
        select.select([w._sock for w in sockets], [], [], timeout_s)
    except (OSError, ValueError):  # EBADF, or fileno() -1: closed between the two
        return
    for w in sockets:
        w._drain()


class Waker:
    """The writer's end: one byte to every reader's socket in ``directory``."""

    def __init__(self, directory: str) -> None:
        self._dir = directory
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def wake(self) -> None:
        try:
            names = [e.name for e in os.scandir(self._dir) if e.name.startswith(PREFIX)]
        except OSError:
            return
        for name in names:
            path = os.path.join(self._dir, name)
            try:
                self._sock.sendto(b"\1", path)
            except (ConnectionRefusedError, FileNotFoundError):
                try:  # nobody is bound there: a reader that died without closing
                    os.unlink(path)
                except OSError:
                    pass
            except OSError:  # a full queue (the reader is awake anyway), or not allowed
                pass

    def close(self) -> None:
        self._sock.close()
