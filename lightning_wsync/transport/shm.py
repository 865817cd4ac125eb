"""Same-host data plane: one shared-memory snapshot, read by every local receiver.

The sender's snapshot *is* the shared segment, so a push writes the bytes once and
each receiver copies them once, straight into its own parameters. The writer never
waits for readers (a dead or stopped reader cannot hurt it); readers detect a snapshot
overwritten under them with a sequence counter (seqlock) in the segment's header:
odd while the writer is copying, bumped again when it is done. A reader copies only
when the counter equals the generation published for the version, and re-checks it
afterwards; a change means the copy may be torn and is redone from the newer version.
"""

from __future__ import annotations

import glob
import logging
import mmap
import os
import re
import threading
import warnings

import torch

from lightning_wsync._control import open_segment, pid_alive
from lightning_wsync._manifest import Layout, checksum, copy_tensors, entry_views
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"
_HEADER_BYTES = 4096  # keeps the data page aligned
_MAGIC = 0x7773796E63  # "wsync"
# header int64 slots
_SEQ, _VERSION, _MAGIC_SLOT = 0, 1, 2

# A lock round trip is a full memory barrier on every platform CPython supports; it
# orders the counter update against the bulk copy around it.
_fence_lock = threading.Lock()


def _fence() -> None:
    with _fence_lock:
        pass


def segment_name(job: str, epoch: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:64]
    return f"wsync-{os.getpid()}-{epoch}-{safe}"


class ShmSegment:
    """A named shared-memory region: a small header followed by the snapshot bytes."""

    def __init__(self, name: str, nbytes: int, *, create: bool) -> None:
        self.name = name
        self.path = os.path.join(_SHM_DIR, name)
        self._owner = create
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL if create else os.O_RDONLY
        fd = open_segment(self.path, flags)  # name checked, no symlink, a regular file of this user
        try:
            if create:
                try:
                    # Reserve the pages now: a full /dev/shm then fails here, with an error,
                    # instead of killing the trainer with SIGBUS on its first snapshot.
                    os.posix_fallocate(fd, 0, _HEADER_BYTES + nbytes)
                except OSError as exc:
                    os.unlink(self.path)
                    raise WeightSyncError(
                        f"shared memory: cannot reserve {(_HEADER_BYTES + nbytes) / 2**20:.1f} MiB in "
                        f"{_SHM_DIR} ({exc.strerror}); enlarge /dev/shm (docker: --shm-size), push fewer "
                        f"tensors (include=/exclude=), cast (dtype='bfloat16'), or use transport='gloo'"
                    ) from exc
            size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if create else 0)
            # MAP_POPULATE maps every page now: otherwise the first push pays one page
            # fault per 4 KiB (at 1 GiB, ~0.6 s of the trainer's stall).
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, prot)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            # Readers map read-only on purpose; torch warns that it cannot write there.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            whole = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.header = whole[:_HEADER_BYTES].view(torch.int64)
        self.data = whole[_HEADER_BYTES:]
        if create:
            self.header[_MAGIC_SLOT] = _MAGIC
        elif int(self.header[_MAGIC_SLOT]) != _MAGIC:
            raise WeightSyncError(f"shared memory segment {self.path!r} is not a wsync snapshot")

    # -- writer -------------------------------------------------------------------
    def begin_write(self) -> None:
        self.header[_SEQ] += 1  # odd: readers must not trust the bytes
        _fence()

    def end_write(self, version: int) -> int:
        _fence()
        self.header[_VERSION] = version
        self.header[_SEQ] += 1
        return int(self.header[_SEQ])

    # -- reader -------------------------------------------------------------------
    def sequence(self) -> int:
        return int(self.header[_SEQ])

    def version(self) -> int:
        """Version of the last completed write (meaningful while the sequence is even)."""
        return int(self.header[_VERSION])

    def close(self) -> None:
        del self.header, self.data
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view escaped; the mapping dies with the process
        if self._owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def remove_stale_segments() -> None:
    """Unlink segments whose creating process is gone (a sender that was SIGKILLed)."""
    for path in glob.glob(os.path.join(_SHM_DIR, "wsync-*")):
        match = re.match(r"wsync-(\d+)-", os.path.basename(path))
        if match and not pid_alive(int(match.group(1))):
            try:
                os.unlink(path)
                log.info("removed stale shared-memory snapshot %s", path)
            except OSError:
                pass


class ShmReceiveLink:
    """Applies versions straight from a sender's segment on this host."""

    def __init__(self, segment_name_: str, layout: Layout) -> None:
        self._segment = ShmSegment(segment_name_, layout.total_bytes, create=False)
        self._layout = layout
        self._views = entry_views(layout, self._segment.data)

    def try_apply(self, gen: int, tensors: list[torch.Tensor]) -> bool:
        """Copy the snapshot of generation ``gen`` into ``tensors``.

        Returns False, having copied nothing usable, when the snapshot is not (or no
        longer) that generation; the caller then retries with the newer version.
        """
        seg = self._segment
        if seg.sequence() != gen:
            return False
        _fence()
        copy_tensors(tensors, self._views)
        _fence()
        return seg.sequence() == gen

    def sequence(self) -> int:
        return self._segment.sequence()

    def published(self) -> tuple[int, int] | None:
        """(version, generation) of the snapshot as it stands, or None while it is being written.

        Read straight from the segment, before the sender has announced it on the store;
        a write that starts meanwhile is caught by :meth:`try_apply`'s sequence checks.
        """
        seg = self._segment
        gen = seg.sequence()
        if gen == 0 or gen % 2:
            return None
        _fence()
        return seg.version(), gen

    def matches(self, gen: int, sums: list[int]) -> int | None:
        """Index of the first bucket whose checksum differs from ``sums`` (None: all match).

        Only meaningful while the sequence is still ``gen`` (checked by the caller's copy).
        """
        for i, (a, b) in enumerate(self._layout.buckets):
            if checksum(self._segment.data, a, b) != sums[i]:
                return i
        return None

    def stage(self, gen: int, staging: torch.Tensor) -> bool:
        """Copy the snapshot into a private ``staging`` buffer; True when it was not torn."""
        seg = self._segment
        if seg.sequence() != gen:
            return False
        _fence()
        staging.copy_(seg.data[: staging.numel()])
        _fence()
        return seg.sequence() == gen

    def close(self) -> None:
        self._views = []  # views pin the mapping
        self._segment.close()
