"""The sharded plane's receive side: one reader per trainer rank's ring, a version applied
only when every ring holds it complete, pinned in all of them while it is copied."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.shards import ShardPlan, piece_views
from lightning_wsync._planes.base import Reject, SumsLookup
from lightning_wsync._planes.shm.segment import ShmReader, SlotRef, remove_stale_segments
from lightning_wsync.errors import WeightSyncIntegrityError

log = logging.getLogger(__name__)

_ATTEMPTS = 64  # a pin fails while a push lands on that slot; each failure is a header read
_COPIES = 8  # copies torn in a row (this process stalled past the pin lease each time) before giving up
_POLL_S = 0.005  # ranks finish their shares at different times; each rank's writer wakes only its own readers


class ShardedSource:
    """Trainer ranks' rings on this host, applied version by version, all shares or none."""

    def __init__(
        self, epoch: int, layout: Manifest, plan: ShardPlan, shares: list[Manifest], ordered: list[torch.Tensor],
        name: str,
    ) -> None:  # fmt: skip
        self.epoch = epoch
        self.layout = layout
        self._name = name
        self._shares = shares
        self._dst = [piece_views(plan, rank, layout, ordered) for rank in range(plan.world)]
        self._readers: list[ShmReader] = []
        try:
            for segment, share in zip(plan.segments, shares):
                self._readers.append(ShmReader(segment, share))
        except BaseException:
            self.close()
            raise
        self._rejected: int | None = None

    def _common(self) -> dict[int, list[SlotRef]]:
        """version -> its slot in every rank's ring, for the versions complete in all of them."""
        found: dict[int, list[SlotRef]] = {}
        for rank, reader in enumerate(self._readers):
            refs = {ref.version: ref for ref in reader.complete()}
            if rank == 0:
                found = {v: [ref] for v, ref in refs.items()}
            else:
                found = {v: [*got, refs[v]] for v, got in found.items() if v in refs}
        return found

    def _newest(self, held: int | None, torn: bool) -> tuple[int, list[SlotRef]] | None:
        common = self._common()
        if not common:
            return None
        version = max(common)
        if (held is not None and version <= held and not torn) or version == self._rejected:
            return None
        return version, common[version]

    def apply(self, held: int | None, sums: SumsLookup | None, reject: Reject) -> int | None:
        torn = False
        copies = 0
        for _ in range(_ATTEMPTS):
            found = None if copies == _COPIES else self._newest(held, torn)
            if found is None:
                break
            version, refs = found
            expected = sums(version) if sums is not None else None
            if sums is not None and expected is None:
                break  # its checksums are not published yet; a later update() applies it
            pinned = self._pin(refs)
            if pinned is None:
                continue
            if expected is not None and not self._verified(version, refs, expected, reject):
                self._unpin(refs)
                break
            for reader, ref, dst in zip(self._readers, refs, self._dst):
                reader.copy_to(ref, dst)
            copies += 1
            if self._unpin(refs):
                return version
            torn = True  # a share was overwritten under us after a stall past the lease: copy the newest again
        if torn:
            raise WeightSyncIntegrityError(
                f"WeightReceiver {self._name!r}: a trainer rank's shared snapshot was overwritten under the copy "
                f"{copies} times in a row (this process stalled past the sender's pin lease); the module may hold a "
                f"torn copy. Check what stops this process, or push less often"
            )
        return None

    def _pin(self, refs: list[SlotRef]) -> list[SlotRef] | None:
        for i, (reader, ref) in enumerate(zip(self._readers, refs)):
            if not reader.pin(ref):
                self._unpin(refs[:i])
                return None
        return refs

    def _unpin(self, refs: list[SlotRef]) -> bool:
        """Let go of every pin; True when all of them stayed intact."""
        return all([reader.unpin(ref) for reader, ref in zip(self._readers, refs)])

    def _verified(self, version: int, refs: list[SlotRef], expected: list[int], reject: Reject) -> bool:
        at = 0
        for rank, (reader, ref, share) in enumerate(zip(self._readers, refs, self._shares)):
            count = len(share.buckets)
            bad = reader.mismatch(ref, expected[at : at + count]) if len(expected) >= at + count else 0
            if bad is not None:
                self._rejected = version
                a, b = share.buckets[bad]
                reject(version, f"checksum mismatch in trainer rank {rank}'s share, first bad bytes [{a}, {b})")
                return False
            at += count
        return True

    def pending_above(self, held: int | None) -> bool:
        return self._newest(held, False) is not None

    def wait_change(self, until: float, give_up: Callable[[], bool]) -> bool:
        """Until any rank's ring moves (rank 0's writer wakes this reader; the others are read every _POLL_S)."""
        try:
            seen = [r.change_marker() for r in self._readers]
            while time.monotonic() < until and not give_up():
                self._readers[0].wait(min(_POLL_S, max(0.0, until - time.monotonic())))
                if [r.change_marker() for r in self._readers] != seen:
                    break
        except (AttributeError, ValueError, IndexError):
            pass  # closed under us (a new sender epoch): the caller looks again
        return True

    def describe(self) -> str:
        ipc = sum(r.device_copies for r in self._readers)
        how = f", {ipc} copied from the trainer's GPUs (CUDA IPC)" if ipc else ""
        return f"shared memory, sharded over {len(self._readers)} trainer ranks{how}"

    def close(self) -> None:
        readers, self._readers = self._readers, []
        for reader in readers:
            reader.close()
        remove_stale_segments()  # a trainer rank SIGKILLed leaves its ring behind
