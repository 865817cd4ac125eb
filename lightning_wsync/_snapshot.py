"""The sender's snapshot: the flat buffer a push writes, guarded by a sequence counter.

Delivery threads read the buffer while the training loop may already be writing the
next version into it; the counter (odd while writing) lets every reader tell whether
the bytes it sent or hashed belong to one version.
"""

from __future__ import annotations

import threading

import torch

from lightning_wsync._manifest import Layout, checksum, copy_tensors, entry_views
from lightning_wsync.transport.shm import ShmSegment


def bucket_checksums(buffer: torch.Tensor, layout: Layout) -> list[int]:
    """xxh3-64 of every bucket of a CPU buffer."""
    return [checksum(buffer, a, b) for a, b in layout.buckets]



class Snapshot:
    """Preallocated buffer plus seqlock; in shared memory when ``segment`` is given."""

    def __init__(self, layout: Layout, *, segment: ShmSegment | None, device: torch.device) -> None:
        self.layout = layout
        self.segment = segment
        if segment is not None:
            self.buffer = segment.data[: layout.total_bytes]
        else:
            self.buffer = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
        self._views = entry_views(layout, self.buffer)
        self._seq = 0
        self._published: tuple[int, int] | None = None  # (version, gen)
        self._cond = threading.Condition()
        self._sums: tuple[int, list[int]] | None = None  # (gen, checksums)
        self._sums_lock = threading.Lock()
        self.closed = False

    @property
    def sequence(self) -> int:
        return self.segment.sequence() if self.segment is not None else self._seq

    def write(self, version: int, tensors: list[torch.Tensor]) -> int:
        """Copy ``tensors`` in; returns the generation that identifies these bytes."""
        if self.segment is not None:
            self.segment.begin_write()
        else:
            self._seq += 1
        copy_tensors(self._views, tensors)
        if self.buffer.is_cuda or any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()  # the copies were queued without blocking; finish them
        if self.segment is not None:
            gen = self.segment.end_write(version)
        else:
            self._seq += 1
            gen = self._seq
        with self._cond:
            self._published = (version, gen)
            self._cond.notify_all()
        return gen

    def newest(self) -> tuple[int, int] | None:
        return self._published

    def wait_newer(self, after_version: int | None, timeout_s: float) -> tuple[int, int] | None:
        """Block up to ``timeout_s`` for a version above ``after_version``."""
        with self._cond:
            self._cond.wait_for(
                lambda: self.closed
                or (self._published is not None and (after_version is None or self._published[0] > after_version)),
                timeout=timeout_s,
            )
            if self._published is None or self.closed:
                return None
            if after_version is not None and self._published[0] <= after_version:
                return None
            return self._published

    def checksums(self, gen: int) -> list[int] | None:
        """Per-bucket checksums of generation ``gen``, computed once; None if overwritten."""
        with self._sums_lock:
            if self._sums is not None and self._sums[0] == gen:
                return self._sums[1]
            if self.sequence != gen or self.buffer.is_cuda:
                return None
            sums = bucket_checksums(self.buffer, self.layout)
            if self.sequence != gen:
                return None
            self._sums = (gen, sums)
            return sums

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
