"""Same-host data plane: a ring of snapshot slots in one shared-memory segment, with reader pins.

The sender writes each version into a slot nobody is reading; same-host receivers copy
the newest complete slot straight into their own parameters while holding a *pin* on
it, so its bytes cannot change under the copy. A pin is a few words in a small file of
the reader's own in a directory beside the segment (readers never write the segment).

Pinning is Dekker-style, with a full fence on both sides (:mod:`.fence`): the writer
marks a slot as being written (odd sequence), fences, then looks for pins on it and
backs off if it finds one; a reader writes its pin, fences, then re-reads the slot's
sequence and lets go if it moved. At least one of the two sees the other, so a reader that passes the
re-check copies bytes that stay intact until it unpins. A pin expires when its process
is gone or after ``lease_s``; only a reader stalled that long mid-copy can be
overwritten, and it notices (the sequence moved) and copies again.

Longer than 300 lines: the writer's segment and the reader's side of one pin protocol, kept together.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Sequence

import torch

from lightning_wsync._control.manifest import Manifest, checksum, copy_tensors, entry_views
from lightning_wsync._planes.base import SlotRef as SlotRef  # the plane interface's; kept importable here
from lightning_wsync._planes.shm import cuda_ipc
from lightning_wsync._planes.shm.cuda_host import HostRegistration, register, wait_for_copies
from lightning_wsync._planes.shm.fence import fence
from lightning_wsync._planes.shm.files import SHM_DIR, open_segment, pin_dir, reserve, unlink_segment
from lightning_wsync._planes.shm.files import remove_stale_segments as remove_stale_segments
from lightning_wsync._planes.shm.pieces import pieces
from lightning_wsync._planes.shm.pins import ReaderPin
from lightning_wsync._planes.shm.wake import WakeSocket, wait_any
from lightning_wsync.errors import WeightSyncConfigError, WeightSyncError

log = logging.getLogger(__name__)

_PAGE = 4096
_MAGIC = 0x7773796E6332  # "wsync2": the ring layout
_MAX_SLOTS = 64
# header int64 words: magic, slot count, slot stride in bytes, then (seq, version) per slot
_MAGIC_WORD, _SLOTS_WORD, _STRIDE_WORD, _SLOT_BASE = 0, 1, 2, 4
_CLAIM_WAIT_S = 20e-6
_TOUCH_BYTES = 64 << 20  # a reader renews its pin after copying this much: a slow copy is not a stall
_CLAIM_SETTLE_S = 0.5  # far beyond a live writer's look at the pin directory, even on a loaded host


def segment_name(job: str, epoch: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:64]
    return f"wsync-{os.getpid()}-{epoch}-{safe}"


def seq_word_offset(slot: int) -> int:
    """Byte offset of ``slot``'s sequence word (its version word follows) in the header page:
    for a remote reader that reads the words itself (the NIXL plane)."""
    return (_SLOT_BASE + 2 * slot) * 8


def _stride(nbytes: int) -> int:
    return max(_PAGE, (nbytes + _PAGE - 1) // _PAGE * _PAGE)


class ShmSegment:
    """A named shared-memory region: a header page, then ``slots`` snapshot slots."""

    def __init__(self, name: str, nbytes: int, *, create: bool, slots: int = 2) -> None:
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.pin_dir = pin_dir(self.path)
        self._lock = reserve(self.path) if create else None  # held while this segment lives
        size = _PAGE + slots * _stride(nbytes)
        try:
            self._mmap = _map(self.path, size, create, slots)
        except FileExistsError:
            assert self._lock is not None
            shutil.rmtree(self.pin_dir, ignore_errors=True)  # ours; the file someone else made is left alone
            os.close(self._lock)
            raise WeightSyncConfigError(
                f"shared-memory segment {self.path!r} already exists without a pin directory: not one a live "
                f"sender made; remove it, and check who else writes to {SHM_DIR}"
            ) from None
        except BaseException:
            self._release()
            raise
        with warnings.catch_warnings():
            # Readers map read-only on purpose; torch warns that it cannot write there.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            whole = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.header = whole[:_PAGE].view(torch.int64)
        if create:
            self.header[_SLOTS_WORD] = slots
            self.header[_STRIDE_WORD] = _stride(nbytes)
            self.header[_MAGIC_WORD] = _MAGIC
        elif int(self.header[_MAGIC_WORD]) != _MAGIC:
            raise WeightSyncError(f"shared memory segment {self.path!r} is not a wsync snapshot ring")
        self.slots = int(self.header[_SLOTS_WORD])
        stride = int(self.header[_STRIDE_WORD])
        if not 1 <= self.slots <= _MAX_SLOTS or _PAGE + self.slots * stride > whole.numel() or stride < nbytes:
            raise WeightSyncError(f"shared memory segment {self.path!r} has a header that does not fit its size")
        self.data = [whole[_PAGE + i * stride : _PAGE + i * stride + nbytes] for i in range(self.slots)]
        self._whole = whole
        self._writable = create
        self._cuda_lock = threading.Lock()
        self._cuda: HostRegistration | None | bool = False  # False: not tried yet

    def register_cuda(self) -> None:
        """Register the whole mapping with CUDA, once (see :mod:`cuda_host`); a refusal is
        logged and leaves the copies pageable."""
        with self._cuda_lock:
            if self._cuda is False:
                what = "snapshot ring" if self._writable else "receiver"
                self._cuda = register(self._whole, read_only=not self._writable, what=what)

    def copy_to_gpu(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        """``dst[i] <- src[i]`` (views of this mapping) and wait for the copies, with the
        registration held: :meth:`close` from another thread (a receiver switching sources)
        cannot unregister the pages under a DMA transfer."""
        with self._cuda_lock:
            copy_tensors(dst, src)
            wait_for_copies()

    # -- slot words -----------------------------------------------------------------
    def seq(self, slot: int) -> int:
        return int(self.header[_SLOT_BASE + 2 * slot])

    def version(self, slot: int) -> int:
        return int(self.header[_SLOT_BASE + 2 * slot + 1])

    def begin_write(self, slot: int) -> int:
        """Mark ``slot`` as being written; returns the sequence it had (for :meth:`abort_write`).

        A slot whose last write was abandoned (a discarded draft) is still marked: it stays so.
        """
        before = self.seq(slot)
        if before % 2 == 0:
            self.header[_SLOT_BASE + 2 * slot] = before + 1
            fence()
        return before

    def abort_write(self, slot: int, before: int) -> None:
        self.header[_SLOT_BASE + 2 * slot] = before
        fence()

    def end_write(self, slot: int, version: int) -> int:
        fence()
        self.header[_SLOT_BASE + 2 * slot + 1] = version
        fence()
        seq = self.seq(slot) + 1
        self.header[_SLOT_BASE + 2 * slot] = seq
        return seq

    def newest(self, version: int | None = None) -> SlotRef | None:
        """The complete slot with the highest version (or holding ``version``), as the header stands now."""
        refs = [ref for ref in self.complete() if version is None or ref.version == version]
        return max(refs, key=lambda ref: ref.version, default=None)

    def complete(self) -> list[SlotRef]:
        """Every slot that holds a complete version, as the header stands now."""
        refs: list[SlotRef] = []
        for slot in range(self.slots):
            seq = self.seq(slot)
            if seq == 0 or seq % 2:
                continue
            fence()
            held = self.version(slot)
            fence()
            if self.seq(slot) == seq:
                refs.append(SlotRef(slot, seq, held))
        return refs

    def close(self) -> None:
        # Never ``mmap.close()``: it unmaps even while tensor views exist (``torch.frombuffer``
        # holds a reference to the mmap, not a buffer export), and a thread still reading the
        # header then faults. Dropping the references unmaps once the last view is gone.
        with self._cuda_lock:
            if isinstance(self._cuda, HostRegistration):
                self._cuda.release()  # before the pages can be unmapped
            self._cuda = None
        del self.header, self.data, self._whole, self._mmap
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            unlink_segment(self.path)
            os.close(self._lock)
            self._lock = None


def _map(path: str, size: int, create: bool, slots: int) -> mmap.mmap:
    """Map the segment file (created with ``size`` bytes reserved when ``create``)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL if create else os.O_RDONLY
    fd = open_segment(path, flags)  # name checked, no symlink, a regular file of this user
    try:
        if create:
            try:
                # Reserve the pages now: a full /dev/shm then fails here, with an error,
                # instead of killing the trainer with SIGBUS on its first snapshot.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise WeightSyncError(
                    f"shared memory: cannot reserve {size / 2**20:.1f} MiB ({slots} snapshot slots) in "
                    f"{SHM_DIR} ({exc.strerror}); enlarge /dev/shm (docker: --shm-size), push fewer "
                    f"tensors (include=/exclude=), cast (dtype='bfloat16'), or use transport='gloo'"
                ) from exc
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if create else 0)
        # MAP_POPULATE maps every page now: otherwise the first push pays one page
        # fault per 4 KiB (at 1 GiB, ~0.6 s of the trainer's stall).
        return mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED | mmap.MAP_POPULATE, prot)
    finally:
        os.close(fd)


class ShmReader:
    """A receiver's access to a sender's (or host leader's) ring on this host."""

    def __init__(self, segment_name_: str, layout: Manifest) -> None:
        self._segment = ShmSegment(segment_name_, layout.total_bytes, create=False)
        self._layout = layout
        self._views = [entry_views(layout, data) for data in self._segment.data]
        self._pin = ReaderPin(self._segment.pin_dir)
        self._wake = WakeSocket.bind(self._segment.pin_dir)
        self._mirror: list[list[torch.Tensor]] | None | bool = False  # the writer's GPU slots; False: not looked

    @property
    def woken(self) -> bool:
        """Whether the writer wakes this reader when a version lands (else it must poll)."""
        return self._wake is not None

    def wait(self, timeout_s: float) -> None:
        """Until the writer wakes this reader, or ``timeout_s``."""
        if self._wake is not None:
            self._wake.wait(timeout_s)
        else:
            time.sleep(timeout_s)

    def newest(self, version: int | None = None) -> SlotRef | None:
        return self._segment.newest(version)

    @staticmethod
    def wait_any(readers: Sequence[ShmReader], timeout_s: float) -> None:
        """Until the writer of any of ``readers`` wakes it, or ``timeout_s`` (every one must be :attr:`woken`)."""
        sockets = [r._wake for r in readers if r._wake is not None]
        assert len(sockets) == len(readers), "a reader without a wake-up socket polls (ShmReader.wait)"
        wait_any(sockets, timeout_s)

    def complete(self) -> list[SlotRef]:
        return self._segment.complete()

    def change_marker(self) -> tuple[int, ...]:
        """Every slot's sequence: it moves whenever a write starts or ends."""
        return tuple(self._segment.seq(s) for s in range(self._segment.slots))

    def pin(self, ref: SlotRef) -> bool:
        """Pin ``ref``'s slot; False (nothing held) when it is no longer that version."""
        self._pin.hold(ref.slot, ref.seq)
        if self._segment.seq(ref.slot) != ref.seq:  # written meanwhile, or being claimed: take the newest
            self._pin.release()
            return False
        return True

    def hold(self, ref: SlotRef) -> ReaderPin | None:
        """A pin of its own on ``ref``'s slot, beside this reader's (a fleet round's hold, kept while the
        reader goes on pinning other slots); None when the slot no longer holds that version. The caller
        touches it within every writer's lease, then releases and closes it."""
        pin = ReaderPin(self._segment.pin_dir)
        pin.hold(ref.slot, ref.seq)
        if self._segment.seq(ref.slot) != ref.seq:
            pin.release()
            pin.close()
            return None
        return pin

    def unpin(self, ref: SlotRef) -> bool:
        """Let go of ``ref``; True when its bytes stayed intact the whole time."""
        fence()
        intact = self._settled_seq(ref) == ref.seq
        self._pin.release()
        return intact

    def _settled_seq(self, ref: SlotRef) -> int:
        """The slot's sequence once a writer's claim of it is decided, or past _CLAIM_SETTLE_S.

        A writer marks a slot (sequence + 1) before it looks for pins, and puts the
        sequence back when it finds one: while that takes, the pinned bytes are intact.
        A mark that stays longer is a write that went ahead (this pin had expired) and
        was never completed: a writer killed inside it, or a relay leader's discarded
        draft. The bytes are then not what was pinned; the slot stays odd until a writer
        claims it again, and the caller copies the newest complete version instead.
        """
        deadline = time.monotonic() + _CLAIM_SETTLE_S
        seq = self._segment.seq(ref.slot)
        while seq == ref.seq + 1 and time.monotonic() < deadline:
            time.sleep(_CLAIM_WAIT_S)  # the writer is reading the pin directory: microseconds
            seq = self._segment.seq(ref.slot)
        return seq

    def views(self, ref: SlotRef) -> list[torch.Tensor]:
        """``ref``'s entries as read-only views of the segment, in layout order (intact while pinned)."""
        return self._views[ref.slot]

    def touch(self) -> None:
        """Renew the pin: it holds its slot for another lease from now."""
        self._pin.touch()

    def copy_to(self, ref: SlotRef, tensors: list[torch.Tensor]) -> None:
        """Copy the pinned slot into ``tensors``, renewing the pin every _TOUCH_BYTES: only a
        reader that makes no progress for the writer's lease loses its slot."""
        gpu = next((t.device for t in tensors if t.is_cuda), None)
        if gpu is not None and (mirror := self._device_slots(gpu)) is not None:
            with torch.no_grad():  # device to device from the writer's mirror, waited for before the pin moves on
                for dst, src in pieces(tensors, mirror[ref.slot], _TOUCH_BYTES):
                    copy_tensors(dst, src)
                    wait_for_copies()
                    self._pin.touch()
            return
        if gpu is not None:
            self._segment.register_cuda()
        with torch.no_grad():  # flat views of parameters that require grad
            for dst, src in pieces(tensors, self._views[ref.slot], _TOUCH_BYTES):
                if gpu is not None:  # from registered memory the copy is asynchronous: done before the pin moves on
                    self._segment.copy_to_gpu(dst, src)
                else:
                    copy_tensors(dst, src)
                self._pin.touch()

    def _device_slots(self, device: torch.device) -> list[list[torch.Tensor]] | None:
        """The writer's CUDA IPC mirror as entry views per slot, opened once; None without one."""
        if self._mirror is False:
            slots = cuda_ipc.open_mirror(self._segment.pin_dir, device, f"receiver of {self._segment.name}")
            self._mirror = None if slots is None else [entry_views(self._layout, s) for s in slots]
            if slots is not None:
                log.info("%s: copying versions from the trainer's GPU (CUDA IPC)", self._segment.name)
        return self._mirror if isinstance(self._mirror, list) else None

    @property
    def device_copies(self) -> bool:
        """Whether versions are copied from the writer's GPU (CUDA IPC) rather than host memory."""
        return isinstance(self._mirror, list)

    def stage(self, ref: SlotRef, staging: torch.Tensor) -> None:
        staging.copy_(self._segment.data[ref.slot])

    def checksums(self, ref: SlotRef) -> list[int]:
        """Every bucket's checksum of the pinned slot."""
        data = self._segment.data[ref.slot]
        return [checksum(data, a, b) for a, b in self._layout.buckets]

    def mismatch(self, ref: SlotRef, sums: list[int]) -> int | None:
        """Index of the first bucket of the pinned slot whose checksum differs (None: all match)."""
        data = self._segment.data[ref.slot]
        for i, (a, b) in enumerate(self._layout.buckets):
            if checksum(data, a, b) != sums[i]:
                return i
        return None

    def close(self) -> None:
        self._views = []  # views pin the mapping
        self._mirror = None  # the IPC mapping closes once the last view is gone
        self._pin.close()
        if self._wake is not None:
            self._wake.close()
        self._segment.close()
