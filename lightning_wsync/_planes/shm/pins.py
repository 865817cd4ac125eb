"""Pins: which slot (at which sequence) each same-host reader of a ring is copying now.

A pin is a few words in a small file of the reader's own in the segment's pin directory
(readers never write the segment): slot (-1: none), slot sequence, last progress
(CLOCK_MONOTONIC ns), pid, PID namespace. The writer reads them all before it claims a
slot (:class:`PinBoard`); see :mod:`~lightning_wsync._planes.shm.segment` for the protocol.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import time

from lightning_wsync._control.host import pid_alive, pid_namespace
from lightning_wsync._planes.shm.fence import fence

_PIN = struct.Struct("<qqqqq")
_PIN_SLOT_OFFSET, _PIN_TAKEN_OFFSET = 0, 16
_NO_SLOT = -1
_PIDNS = pid_namespace()


class PinBoard:
    """The writer's view of the readers' pins on its segment."""

    def __init__(self, pin_dir: str) -> None:
        self._dir = pin_dir
        self._maps: dict[str, mmap.mmap] = {}

    def pinned(self, slot: int, seq: int, lease_s: float) -> bool:
        """Whether a live reader holds ``slot`` at sequence ``seq``."""
        try:
            names = [e.name for e in os.scandir(self._dir) if e.name.startswith("pin-")]
        except FileNotFoundError:
            return False
        now = time.monotonic_ns()
        found = False
        for name in names:
            pin = self._map(name)
            if pin is None:
                continue
            p_slot, p_seq, taken, pid, pidns = _PIN.unpack_from(pin, 0)
            if p_slot != slot or p_seq != seq:
                continue
            if now - taken > lease_s * 1e9:
                continue  # stalled longer than the lease: it will see the sequence move
            if pidns == _PIDNS and not pid_alive(pid):
                self._forget(name)
                continue
            found = True
        for name in set(self._maps) - set(names):
            self._maps.pop(name).close()
        return found

    def _map(self, name: str) -> mmap.mmap | None:
        pin = self._maps.get(name)
        if pin is not None:
            return pin
        try:
            # Never blocks (a FIFO another process put here), never follows a link.
            fd = os.open(os.path.join(self._dir, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < _PIN.size:
                return None
            pin = self._maps[name] = mmap.mmap(fd, _PIN.size, mmap.MAP_SHARED, mmap.PROT_READ)
            return pin
        finally:
            os.close(fd)

    def _forget(self, name: str) -> None:
        pin = self._maps.pop(name, None)
        if pin is not None:
            pin.close()
        try:
            os.unlink(os.path.join(self._dir, name))
        except OSError:
            pass

    def close(self) -> None:
        for pin in self._maps.values():
            pin.close()
        self._maps.clear()


class ReaderPin:
    """A reader's pin file: which slot (at which sequence) it is copying now."""

    def __init__(self, pin_dir: str) -> None:
        path = os.path.join(pin_dir, f"pin-{os.getpid()}-{id(self):x}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, _PIN.size)
            self._mmap = mmap.mmap(fd, _PIN.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._path = path
        _PIN.pack_into(self._mmap, 0, _NO_SLOT, 0, 0, os.getpid(), _PIDNS)

    def hold(self, slot: int, seq: int) -> None:
        _PIN.pack_into(self._mmap, 0, _NO_SLOT, seq, time.monotonic_ns(), os.getpid(), _PIDNS)
        fence()
        struct.pack_into("<q", self._mmap, _PIN_SLOT_OFFSET, slot)  # the word the writer matches on
        fence()

    def touch(self) -> None:
        """The copy made progress: the pin holds its slot for another lease from now."""
        struct.pack_into("<q", self._mmap, _PIN_TAKEN_OFFSET, time.monotonic_ns())

    def release(self) -> None:
        struct.pack_into("<q", self._mmap, _PIN_SLOT_OFFSET, _NO_SLOT)
        fence()

    def close(self) -> None:
        try:
            self._mmap.close()
        except BufferError:
            pass
        try:
            os.unlink(self._path)
        except OSError:
            pass
