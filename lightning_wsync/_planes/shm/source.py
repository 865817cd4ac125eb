"""The shared-memory plane's receive side: a sender's (or host leader's) ring on this
host, applied slot by pinned slot straight into the module."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from typing_extensions import override

from lightning_wsync._control.manifest import Manifest
from lightning_wsync._planes.base import ExactApply, Lender, ReceiveSource, Reject, SumsLookup
from lightning_wsync._planes.shm.segment import ShmReader, SlotRef, remove_stale_segments
from lightning_wsync.errors import WeightSyncIntegrityError

log = logging.getLogger(__name__)

# A pin fails only when a push lands between reading the header and pinning; a copy is
# torn only when this receiver stalled past the sender's pin lease. Either way the next
# try takes the newest version; this many in a row means something is badly wrong.
_SHARED_ATTEMPTS = 8


_PIN_ATTEMPTS = 64  # a pin fails while a push lands on that slot; each failure is a header read


_WOKEN_POLL_S = 0.02  # a reader the writer wakes still reads the header this often (a lost wake-up)


class SharedMemorySource(ReceiveSource):
    """A sender's ring on this host, applied slot by pinned slot; it lends slots and applies a chosen version."""

    def __init__(self, epoch: int, layout: Manifest, ordered: list[torch.Tensor], reader: ShmReader, name: str) -> None:
        self.epoch = epoch
        self.layout = layout
        self._ordered = ordered
        self._reader = reader
        self._name = name
        self._rejected: int | None = None  # a version that failed its checksums
        self._poll_s = 0.001

    def apply(self, held: int | None, sums: SumsLookup | None, reject: Reject) -> int | None:
        torn = False
        copies = 0
        for _ in range(_PIN_ATTEMPTS):
            if copies == _SHARED_ATTEMPTS:
                break
            ref = self._reader.newest()
            if ref is None or (held is not None and ref.version <= held and not torn) or ref.version == self._rejected:
                if torn:
                    break
                return None
            expected = None
            if sums is not None:
                expected = sums(ref.version)
                if expected is None:
                    if torn:
                        break
                    return None  # its checksums are not published yet; a later update() applies it
            if not self._reader.pin(ref):
                continue
            if expected is not None and not self._verified(ref, expected, reject):
                self._reader.unpin(ref)
                if torn:
                    break
                return None
            self._reader.copy_to(ref, self._ordered)
            copies += 1
            if self._reader.unpin(ref):
                return ref.version
            torn = True  # overwritten under us after a stall past the lease: copy the newest again
        if torn:
            raise WeightSyncIntegrityError(
                f"WeightReceiver {self._name!r}: the shared snapshot was overwritten under {_SHARED_ATTEMPTS} "
                f"copies in a row (this process stalled past the sender's pin lease each time); the module "
                f"may hold a torn copy. Check what stops this process, or push less often"
            )
        return None

    def apply_exactly(self, version: int, sums: SumsLookup | None, reject: Reject) -> int | None:
        """Write ``version`` itself (not the newest) into the module; None when the ring no
        longer holds it, its checksums are not out yet, or it failed them.

        Raises:
            WeightSyncIntegrityError: it was overwritten under the copy (the module holds a torn copy).
        """
        ref = self._pin_verified(version, sums, reject)
        if ref is None:
            return None
        self._reader.copy_to(ref, self._ordered)
        if self._reader.unpin(ref):
            return version
        raise WeightSyncIntegrityError(
            f"WeightReceiver {self._name!r}: version {version} was overwritten in shared memory while "
            f"copied (this process stalled past the sender's pin lease)"
        )

    def lend(
        self, version: int | None, sums: SumsLookup | None, reject: Reject
    ) -> tuple[SlotRef, list[torch.Tensor]] | None:
        """Pin the newest complete slot (or the one holding ``version``) and return it with its
        entries' read-only views, in layout order: no copy. None when there is none, its
        checksums are not out yet, or it failed them. The pin holds until :meth:`give_back`
        as long as :meth:`touch` renews it within the sender's lease."""
        ref = self._pin_verified(version, sums, reject)
        return None if ref is None else (ref, self._reader.views(ref))

    def _pin_verified(self, version: int | None, sums: SumsLookup | None, reject: Reject) -> SlotRef | None:
        """Pin the newest complete slot (or the one holding ``version``) once its checksums,
        when ``sums`` gives them, are out and match; None (nothing pinned) when there is no
        such slot, its checksums are not out yet, or it failed them."""
        for _ in range(_PIN_ATTEMPTS):
            ref = self._reader.newest(version)
            if ref is None or ref.version == self._rejected:
                return None
            expected = None if sums is None else sums(ref.version)
            if sums is not None and expected is None:
                return None
            if not self._reader.pin(ref):
                continue
            if expected is not None and not self._verified(ref, expected, reject):
                self._reader.unpin(ref)
                return None
            return ref
        return None

    def give_back(self, ref: SlotRef) -> bool:
        """Unpin a lent slot; True when its bytes stayed intact the whole time."""
        try:
            return self._reader.unpin(ref)
        except (AttributeError, ValueError):
            return False  # closed under the loan (a new sender epoch): not known to be intact

    def touch(self) -> None:
        try:
            self._reader.touch()
        except ValueError:
            pass  # closed under the loan: give_back says so

    def _verified(self, ref: SlotRef, expected: list[int], reject: Reject) -> bool:
        bad = self._reader.mismatch(ref, expected)
        if bad is None:
            return True
        self._rejected = ref.version
        a, b = self.layout.buckets[bad]
        reject(ref.version, f"checksum mismatch in shared memory, first bad bytes [{a}, {b})")
        return False

    def pending_above(self, held: int | None) -> bool:
        ref = self._reader.newest()
        return ref is not None and (held is None or ref.version > held) and ref.version != self._rejected

    def wait_change(self, until: float, give_up: Callable[[], bool]) -> bool:
        """Wait on the writer's wake-up, reading the ring's header after each and every
        _WOKEN_POLL_S; without a wake-up socket, read it every ``_poll_s`` (1 ms: ~3% of a core)."""
        try:
            seen = self._reader.change_marker()
            poll_s = max(self._poll_s, _WOKEN_POLL_S) if self._reader.woken else self._poll_s
            while time.monotonic() < until and not give_up():
                self._reader.wait(min(poll_s, max(0.0, until - time.monotonic())))
                if self._reader.change_marker() != seen:
                    break
        except (AttributeError, ValueError, OSError):
            pass  # closed under us (a new sender epoch, a relay host's new leader): the caller looks again
        return True

    @override
    def lender(self) -> Lender:
        return self

    @override
    def exact(self) -> ExactApply:
        return self

    def describe(self) -> str:
        ipc = self._reader.device_copies
        return "shared memory, copied from the trainer's GPU (CUDA IPC)" if ipc else "shared memory"

    def close(self) -> None:
        self._reader.close()
        remove_stale_segments()  # a sender SIGKILLed before this epoch ended leaves its ring behind
