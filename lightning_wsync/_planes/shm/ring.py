"""The sender's snapshot ring: a version is never overwritten while anyone reads it.

A push writes into a slot no reader holds (preferring the oldest version) and never
waits for readers: when every slot is held, the push is *dropped* — counted, reported,
and the next push carries newer weights — unless the caller allows a bounded wait (the
final push of a run). Readers are same-host receivers (pins in shared memory, see
:mod:`~lightning_wsync._planes.shm.segment`) and this process's network links (leases here).
A pin or lease that makes no progress for ``lease_s`` no longer protects its slot: a
stalled reader cannot hold versions back from everyone else.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from lightning_wsync._control.manifest import Manifest, checksum, copy_tensors, entry_views
from lightning_wsync._planes.shm import cuda_ipc
from lightning_wsync._planes.shm.cuda_host import CopyStream
from lightning_wsync._planes.shm.segment import ShmSegment, SlotRef
from lightning_wsync._planes.shm.slots import slot_store

log = logging.getLogger(__name__)

_WAIT_POLL_S = 0.001


def bucket_checksums(buffer: torch.Tensor, layout: Manifest) -> list[int]:
    """xxh3-64 of every bucket of a CPU buffer."""
    return [checksum(buffer, a, b) for a, b in layout.buckets]


@dataclass
class Lease:
    """An in-process reader's hold on one slot (a network link sending it, a checksum pass)."""

    ring: SnapshotRing
    ref: SlotRef
    progress_ns: int = field(default_factory=time.monotonic_ns)

    @property
    def buffer(self) -> torch.Tensor:
        return self.ring.buffers[self.ref.slot]

    def touch(self) -> None:
        """Progress was made (a bucket went out): the lease stays valid for another ``lease_s``."""
        self.progress_ns = time.monotonic_ns()

    def intact(self) -> bool:
        return self.ring.seq(self.ref.slot) == self.ref.seq

    def release(self) -> None:
        self.ring._release(self)

    def checksums(self) -> list[int] | None:
        return self.ring.checksums(self)


@dataclass
class Draft:
    """A claimed slot, marked as being written, that its writer fills in place (a relay
    leader receives a version straight into its host ring: no copy once it is verified)."""

    ring: SnapshotRing
    slot: int
    before: int  # the slot's sequence when claimed

    @property
    def buffer(self) -> torch.Tensor:
        return self.ring.buffers[self.slot]

    def commit(self, version: int) -> SlotRef:
        """Publish what the buffer now holds as ``version``."""
        return self.ring._end_write(self.slot, version)

    def discard(self) -> None:
        """Give the slot up unpublished: it stays marked as being written, so no reader ever
        takes what is in it, and the next claim may take it again."""


class SnapshotRing:
    """``slots`` preallocated flat buffers; in shared memory when ``segment`` is given.

    ``mirror``: also keep the slots on this GPU, shared with same-host GPU readers by
    CUDA IPC (:mod:`~lightning_wsync._planes.shm.cuda_ipc`; needs ``segment``).
    """

    def __init__(
        self, layout: Manifest, *, segment: ShmSegment | None, device: torch.device, slots: int = 2, lease_s: float,
        mirror: torch.device | None = None,
    ) -> None:  # fmt: skip
        self.layout = layout
        self.segment = segment
        self.lease_s = lease_s
        self._slots = slot_store(segment, layout.total_bytes, device, slots)
        self.buffers = self._slots.buffers
        self._views = [entry_views(layout, b) for b in self.buffers]
        self._cond = threading.Condition()
        self._leases: list[Lease] = []
        self._published: SlotRef | None = None
        self._sums: dict[SlotRef, list[int]] = {}
        self.dropped = 0  # pushes that found every slot held
        self._copy_stream = CopyStream()
        self.closed = False
        self._mirror: list[torch.Tensor] | None = None
        if mirror is not None:
            assert segment is not None, "a CUDA IPC mirror is read through the segment's pins"
            self._mirror = cuda_ipc.mirror(layout.total_bytes, len(self.buffers), mirror)
            self._mirror_views = [entry_views(layout, b) for b in self._mirror]
            cuda_ipc.export(self._mirror, segment.pin_dir)

    @property
    def mirror(self) -> list[torch.Tensor] | None:
        """The slots' GPU mirror (``cuda_ipc=True``), one flat buffer per slot; None without one."""
        return self._mirror

    # -- slot words -------------------------------------------------------------------
    def seq(self, slot: int) -> int:
        return self._slots.seq(slot)

    def _version(self, slot: int) -> int:
        return self._slots.version(slot)

    # -- writer -----------------------------------------------------------------------
    def write(
        self, version: int, tensors: list[torch.Tensor], *, wait_s: float = 0.0, wake: bool = True
    ) -> SlotRef | None:
        """Snapshot ``tensors`` as ``version`` into a free slot; None when every slot is held.

        ``wait_s`` bounds a wait for a slot to come free (0: drop at once). ``wake=False``
        leaves waking same-host readers to the caller (:meth:`wake_readers`): the sender
        times the snapshot alone, and a woken reader must not apply inside that time.
        """
        deadline = time.monotonic() + wait_s
        while (claimed := self._claim()) is None:
            if time.monotonic() >= deadline or self.closed:
                self.dropped += 1
                return None
            time.sleep(_WAIT_POLL_S)
        slot, before = claimed
        buffer = self.buffers[slot]
        device = buffer.device if buffer.is_cuda else next((t.device for t in tensors if t.is_cuda), None)
        if device is None:
            copy_tensors(self._views[slot], tensors)
        else:
            if not buffer.is_cuda:
                self._slots.register_cuda()  # once: the device-to-host copies then run at DMA speed
            # On a stream of the ring's own; published only once the bytes landed.
            self._copy_stream.run(device, lambda: self._copy_from_gpu(slot, tensors))
        return self._end_write(slot, version, wake=wake)

    def _copy_from_gpu(self, slot: int, tensors: list[torch.Tensor]) -> None:
        if self._mirror is None:
            copy_tensors(self._views[slot], tensors)
        else:  # the mirror first (device to device), then the host slot from it: the same bytes
            copy_tensors(self._mirror_views[slot], tensors)
            self.buffers[slot].copy_(self._mirror[slot], non_blocking=True)

    def draft(self) -> Draft | None:
        """A free slot to be written in place and then committed or discarded; None when every slot is held."""
        claimed = self._claim()
        return None if claimed is None else Draft(self, *claimed)

    def _end_write(self, slot: int, version: int, *, wake: bool = True) -> SlotRef:
        with self._cond:
            seq = self._slots.publish(slot, version)
            ref = SlotRef(slot, seq, version)
            current = self._published
            if current is None or current.slot == slot or version >= current.version:
                self._published = ref  # a relay leader may commit a resent, older version: newest stays newest
            self._cond.notify_all()
        if wake:
            self.wake_readers()
        return ref

    def wake_readers(self) -> None:
        """Poke same-host readers: they wait on their wake-up sockets for a new version."""
        self._slots.wake()

    def _claim(self) -> tuple[int, int] | None:
        """A slot nobody holds, now marked as being written, and its sequence before."""
        with self._cond:
            now = time.monotonic_ns()
            lease_ns = self.lease_s * 1e9
            order = sorted(range(len(self.buffers)), key=lambda s: (self.seq(s) != 0, self._version(s)))
            for slot in order:
                seq = self.seq(slot)
                self._sums = {r: v for r, v in self._sums.items() if r.slot != slot or r.seq == seq}
                held = [le for le in self._leases if le.ref.slot == slot and le.ref.seq == seq]
                if any(now - le.progress_ns <= lease_ns for le in held):
                    continue
                before = self._slots.claim(slot, self.lease_s)
                if before is not None:
                    return slot, before
        return None

    # -- in-process readers ---------------------------------------------------------------
    def newest(self) -> SlotRef | None:
        return self._published

    def acquire_newer(self, after_version: int | None, timeout_s: float) -> Lease | None:
        """Wait up to ``timeout_s`` for a version above ``after_version``; lease its slot.

        Only a slot that still holds the published version: a writer may have claimed it
        since (every other slot held, or a relay leader's draft), and a lease on it would
        send bytes being rewritten.
        """

        def newer() -> bool:
            ref = self._published
            return (ref is not None and (after_version is None or ref.version > after_version)
                    and self.seq(ref.slot) == ref.seq)  # fmt: skip

        with self._cond:
            self._cond.wait_for(lambda: self.closed or newer(), timeout=timeout_s)
            if self.closed or not newer():
                return None
            assert self._published is not None
            return self._lease(self._published)

    def describe(self) -> str:
        """Slots as (sequence, version, leased), for logs."""
        with self._cond:
            return ", ".join(
                f"slot {s}: seq {self.seq(s)} version {self._version(s)} leases "
                f"{sum(le.ref.slot == s for le in self._leases)}"
                for s in range(len(self.buffers))
            )

    def find(self, version: int) -> SlotRef | None:
        """The slot holding ``version`` complete (a delta's base), if the ring still has it."""
        with self._cond:
            for slot in range(len(self.buffers)):
                seq = self.seq(slot)
                if seq and seq % 2 == 0 and self._version(slot) == version:
                    return SlotRef(slot, seq, version)
        return None

    def hold(self, version: int) -> Lease | None:
        """Lease the slot holding ``version`` complete, if the ring still has it (``base.Snapshots``)."""
        ref = self.find(version)
        return None if ref is None else self.acquire(ref)

    def acquire(self, ref: SlotRef) -> Lease | None:
        """Lease ``ref``'s slot if it still holds that version."""
        with self._cond:
            return self._lease(ref) if self.seq(ref.slot) == ref.seq else None

    def _lease(self, ref: SlotRef) -> Lease:
        lease = Lease(self, ref)
        self._leases.append(lease)
        return lease

    def _release(self, lease: Lease) -> None:
        with self._cond:
            if lease in self._leases:
                self._leases.remove(lease)

    def checksums(self, lease: Lease) -> list[int] | None:
        """Per-bucket checksums of the leased version, computed once; None if it was overwritten."""
        ref = lease.ref
        with self._cond:
            cached = self._sums.get(ref)
        if cached is not None:
            return cached
        if lease.buffer.is_cuda:
            return None
        sums = bucket_checksums(lease.buffer, self.layout)
        if not lease.intact():
            return None
        with self._cond:
            if self.seq(ref.slot) == ref.seq:
                self._sums[ref] = sums
        return sums

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        if self._mirror is not None and self.segment is not None:
            cuda_ipc.withdraw(self.segment.pin_dir)
        self._slots.close()
