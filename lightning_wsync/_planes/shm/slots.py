"""Where a snapshot ring's slots live: in a shared-memory segment that same-host readers
pin, or in this process's memory (a CUDA ring, a sender with no same-host receivers).

The ring (:class:`~lightning_wsync._planes.shm.ring.SnapshotRing`) keeps its in-process
leases itself and asks its :class:`SlotStore` only for what differs: where a slot's
sequence and version words are, and whether a reader outside this process holds a slot.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lightning_wsync._planes.shm.cuda_host import HostRegistration, register
from lightning_wsync._planes.shm.pins import PinBoard
from lightning_wsync._planes.shm.segment import ShmSegment
from lightning_wsync._planes.shm.wake import Waker


class SlotStore(Protocol):
    """A ring's slot buffers and their (sequence, version) words.

    A slot's sequence is even when it holds a complete version and odd while it is
    being written (or after an abandoned write); it grows by one at each mark and each
    completion, so a reader that saw sequence ``s`` knows the bytes are the same while
    the sequence still is ``s``.
    """

    buffers: list[torch.Tensor]

    def seq(self, slot: int) -> int: ...
    def version(self, slot: int) -> int: ...

    def claim(self, slot: int, lease_s: float) -> int | None:
        """Mark ``slot`` as being written and return its sequence before; None (left as
        it was) when a reader outside this process holds it."""
        ...

    def publish(self, slot: int, version: int) -> int:
        """End the write of a claimed ``slot``: it now holds ``version``; returns its sequence."""
        ...

    def wake(self) -> None:
        """Tell readers outside this process that a version landed."""
        ...

    def register_cuda(self) -> None:
        """Register host-memory slots with CUDA (once; see :mod:`cuda_host`): the
        ring's writer copies from a GPU."""
        ...

    def close(self) -> None: ...


class PrivateSlots:
    """Slots in this process's memory: only this process's leases hold them."""

    def __init__(self, nbytes: int, device: torch.device, slots: int) -> None:
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        self._seqs = [0] * slots
        self._versions = [-1] * slots
        self._cuda: list[HostRegistration] | None = None

    def seq(self, slot: int) -> int:
        return self._seqs[slot]

    def version(self, slot: int) -> int:
        return self._versions[slot]

    def claim(self, slot: int, lease_s: float) -> int | None:
        before = self._seqs[slot]
        self._seqs[slot] = before | 1  # odd: being written (still so after a discarded draft)
        return before

    def publish(self, slot: int, version: int) -> int:
        self._versions[slot] = version
        self._seqs[slot] += 1
        return self._seqs[slot]

    def wake(self) -> None:
        pass

    def register_cuda(self) -> None:
        if self._cuda is None:
            got = [register(b, read_only=False, what="snapshot ring") for b in self.buffers if not b.is_cuda]
            self._cuda = [r for r in got if r is not None]

    def close(self) -> None:
        for registration in self._cuda or ():
            registration.release()


class SharedSlots:
    """Slots in a shared-memory segment: readers on this host pin them (see :mod:`segment`)."""

    def __init__(self, segment: ShmSegment) -> None:
        self.buffers = list(segment.data)
        self._segment = segment
        self._board = PinBoard(segment.pin_dir)
        self._waker = Waker(segment.pin_dir)

    def seq(self, slot: int) -> int:
        return self._segment.seq(slot)

    def version(self, slot: int) -> int:
        return self._segment.version(slot)

    def claim(self, slot: int, lease_s: float) -> int | None:
        before = self._segment.begin_write(slot)
        if self._board.pinned(slot, before, lease_s):
            self._segment.abort_write(slot, before)
            return None
        return before

    def publish(self, slot: int, version: int) -> int:
        return self._segment.end_write(slot, version)

    def wake(self) -> None:
        self._waker.wake()

    def register_cuda(self) -> None:
        self._segment.register_cuda()

    def close(self) -> None:
        self._board.close()
        self._waker.close()


def slot_store(segment: ShmSegment | None, nbytes: int, device: torch.device, slots: int) -> SlotStore:
    """The ring's slots: in ``segment`` when given, else ``slots`` private buffers on ``device``."""
    return SharedSlots(segment) if segment is not None else PrivateSlots(nbytes, device, slots)
