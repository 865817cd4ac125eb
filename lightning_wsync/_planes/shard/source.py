"""The sharded plane's receive side: one ring per trainer rank's share, a version applied only
when every ring holds it complete, pinned in all of them while it is copied.

A ring is a trainer rank's own (same host, :class:`FixedRing`) or, across hosts, the host
ring its stream's leader fills (:mod:`~lightning_wsync._planes.relay.sharded`); either way a
:class:`ShareRing`, held while a copy reads it.

Longer than 300 lines: the copy into the module and the loan to an engine's workers
(zero-copy: every ring pinned together, a cut tensor stitched) share the rings' pins.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.shards import ShardPlan, piece_views
from lightning_wsync._planes.base import ExactApply, Lender, ReceiveSource, Reject, SumsLookup
from lightning_wsync._planes.shm.segment import ShmReader, SlotRef, remove_stale_segments
from lightning_wsync.errors import WeightSyncIntegrityError

log = logging.getLogger(__name__)

_ATTEMPTS = 64  # a pin fails while a push lands on that slot; each failure is a header read
_COPIES = 8  # copies torn in a row (this process stalled past the pin lease each time) before giving up
_POLL_S = 0.005  # a ring its writer does not wake here (a relay's host ring swapped by its leader): read this often
_WOKEN_POLL_S = 0.02  # rings whose writers wake this reader: their headers still read this often (a lost wake-up)


class ShareRing(Protocol):
    """One trainer rank's share as this receiver reads it."""

    def held(self) -> contextlib.AbstractContextManager[ShmReader | None]:
        """The ring's reader (None: not readable yet), kept open until the context ends."""
        ...

    def close(self) -> None: ...


class FixedRing:
    """A trainer rank's own ring, on this host."""

    def __init__(self, segment: str, share: Manifest) -> None:
        self._reader: ShmReader | None = ShmReader(segment, share)

    @contextlib.contextmanager
    def held(self) -> Iterator[ShmReader | None]:
        yield self._reader

    def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()


class ShardedSource(ReceiveSource):
    """Trainer ranks' rings on this host, applied version by version, all shares or none."""

    def __init__(
        self, epoch: int, layout: Manifest, plan: ShardPlan, shares: list[Manifest], ordered: list[torch.Tensor],
        name: str, rings: Sequence[ShareRing], *, owned: Sequence[Callable[[], None]] = (), describe: str = "",
        verify: bool = True,
    ) -> None:  # fmt: skip
        """``rings``: one per rank, closed with this source, after the ``owned`` closers (the relay's members);
        ``verify``: check published checksums (False: each share was verified on its way here)."""
        self.epoch = epoch
        self.layout = layout
        self._name = name
        self._shares = shares
        self._dst = [piece_views(plan, rank, layout, ordered) for rank in range(plan.world)]
        self._rings = list(rings)
        self._owned = list(owned)
        self._verify = verify
        self._describe = describe or f"shared memory, sharded over {len(self._rings)} trainer ranks"
        self._idle = threading.Event()  # set by close(): a waiter leaves at once
        self._rejected: int | None = None
        # Zero-copy loans (an engine worker's): only when every ring is a trainer rank's own on this host.
        self._lends = bool(self._rings) and all(isinstance(ring, FixedRing) for ring in self._rings)
        self._plan = plan
        self._loan: tuple[list[ShmReader], list[SlotRef]] | None = None  # every ring's pinned slot, while lent
        self._stitched: dict[int, torch.Tensor] = {}  # entry -> a tensor cut across ranks, stitched here

    @contextlib.contextmanager
    def _held(self) -> Iterator[list[ShmReader] | None]:
        """Every rank's reader, held (a stream's leader cannot swap it) until the context ends; None
        while any is not readable."""
        with contextlib.ExitStack() as stack:
            readers = [stack.enter_context(ring.held()) for ring in self._rings]
            yield None if any(r is None for r in readers) or not readers else [r for r in readers if r is not None]

    def _common(self, readers: list[ShmReader]) -> dict[int, list[SlotRef]]:
        """version -> its slot in every rank's ring, for the versions complete in all of them."""
        found: dict[int, list[SlotRef]] = {}
        for rank, reader in enumerate(readers):
            refs = {ref.version: ref for ref in reader.complete()}
            if rank == 0:
                found = {v: [ref] for v, ref in refs.items()}
            else:
                found = {v: [*got, refs[v]] for v, got in found.items() if v in refs}
        return found

    def _newest(self, readers: list[ShmReader], held: int | None, torn: bool) -> tuple[int, list[SlotRef]] | None:
        common = self._common(readers)
        if not common:
            return None
        version = max(common)
        if (held is not None and version <= held and not torn) or version == self._rejected:
            return None
        return version, common[version]

    def apply(self, held: int | None, sums: SumsLookup | None, reject: Reject) -> int | None:
        with self._held() as readers:
            return None if readers is None else self._apply(readers, held, sums if self._verify else None, reject)

    def _apply(self, readers: list[ShmReader], held: int | None, sums: SumsLookup | None, reject: Reject) -> int | None:
        torn = False
        copies = 0
        for _ in range(_ATTEMPTS):
            found = None if copies == _COPIES else self._newest(readers, held, torn)
            if found is None:
                break
            version, refs = found
            expected = sums(version) if sums is not None else None
            if sums is not None and expected is None:
                break  # its checksums are not published yet; a later update() applies it
            pinned = self._pin(readers, refs)
            if pinned is None:
                continue
            if expected is not None and not self._verified(readers, version, refs, expected, reject):
                self._unpin(readers, refs)
                break
            for reader, ref, dst in zip(readers, refs, self._dst):
                reader.copy_to(ref, dst)
            copies += 1
            if self._unpin(readers, refs):
                return version
            torn = True  # a share was overwritten under us after a stall past the lease: copy the newest again
        if torn:
            raise WeightSyncIntegrityError(
                f"WeightReceiver {self._name!r}: a trainer rank's shared snapshot was overwritten under the copy "
                f"{copies} times in a row (this process stalled past the sender's pin lease); the module may hold a "
                f"torn copy. Check what stops this process, or push less often"
            )
        return None

    def exact(self) -> ExactApply:
        return self

    def lender(self) -> Lender | None:
        """Lends versions out of the ranks' rings when all of them are on this host (the trainer's), else None."""
        return self if self._lends else None

    def lend(
        self, version: int | None, sums: SumsLookup | None, reject: Reject
    ) -> tuple[SlotRef, list[torch.Tensor]] | None:
        """Pin the newest version complete in every ring (or ``version``) in all of them, verified against ``sums``,
        and return it with every entry's read-only view, in layout order: a tensor one rank's share holds whole
        is a view of that rank's ring (no copy); one cut across ranks (FSDP2's rows, a run of a large replicated
        tensor) is stitched into a buffer of this source's, kept for the next loans. Held until :meth:`give_back`,
        renewed by :meth:`touch`; None when there is no such version, its checksums are not out, or it failed them."""
        with self._held() as readers:
            if readers is None:
                return None
            sums = sums if self._verify else None
            for _ in range(_ATTEMPTS):
                common = self._common(readers)
                pick = max(common, default=None) if version is None else version
                refs = None if pick is None or pick == self._rejected else common.get(pick)
                if pick is None or refs is None:
                    return None
                expected = sums(pick) if sums is not None else None
                if sums is not None and expected is None:
                    return None
                if self._pin(readers, refs) is None:
                    continue
                if expected is not None and not self._verified(readers, pick, refs, expected, reject):
                    self._unpin(readers, refs)
                    return None
                self._loan = readers, refs
                return refs[0], self._lent_views(readers, refs)
        return None

    def _lent_views(self, readers: list[ShmReader], refs: list[SlotRef]) -> list[torch.Tensor]:
        entries = self.layout.entries
        views: list[torch.Tensor | None] = [None] * len(entries)
        for rank, (reader, ref) in enumerate(zip(readers, refs)):
            for piece, src in zip(self._plan.shares[rank], reader.views(ref)):
                e = entries[piece.entry]
                if piece.start == 0 and piece.end == math.prod(e.shape):
                    views[piece.entry] = src.view(e.shape)  # the whole tensor in this rank's share
                    continue
                stitched = self._stitched.get(piece.entry)
                if stitched is None:
                    stitched = self._stitched[piece.entry] = torch.empty(e.shape, dtype=e.wire_dtype)
                stitched.view(-1)[piece.start : piece.end].copy_(src)
                views[piece.entry] = stitched
        assert all(v is not None for v in views), "a shard plan covers every entry"
        return [v for v in views if v is not None]

    def give_back(self, ref: SlotRef) -> bool:
        """Unpin every ring's lent slot; True when all of them stayed intact the whole time."""
        loan, self._loan = self._loan, None
        if loan is None:
            return False
        try:
            return self._unpin(*loan)
        except (AttributeError, ValueError):
            return False  # closed under the loan (a new sender epoch): not known to be intact

    def touch(self) -> None:
        loan = self._loan
        try:
            for reader in [] if loan is None else loan[0]:
                reader.touch()
        except ValueError:
            pass  # closed under the loan: give_back says so

    def apply_exactly(self, version: int, sums: SumsLookup | None, reject: Reject) -> int | None:
        """Write ``version`` itself (a fleet's round target, not the newest) when every rank's ring still holds
        it complete; None when some ring does not, its checksums are not out yet, or it failed them.

        Raises:
            WeightSyncIntegrityError: a share was overwritten under the copy (the module holds a torn copy).
        """
        with self._held() as readers:
            refs = None if readers is None else self._common(readers).get(version)
            if readers is None or refs is None:
                return None
            sums = sums if self._verify else None
            expected = sums(version) if sums is not None else None
            if (sums is not None and expected is None) or self._pin(readers, refs) is None:
                return None
            if expected is not None and not self._verified(readers, version, refs, expected, reject):
                self._unpin(readers, refs)
                return None
            for reader, ref, dst in zip(readers, refs, self._dst):
                reader.copy_to(ref, dst)
            if self._unpin(readers, refs):
                return version
        raise WeightSyncIntegrityError(
            f"WeightReceiver {self._name!r}: a trainer rank's share of version {version} was overwritten in shared "
            f"memory while copied (this process stalled past the sender's pin lease)"
        )

    def _pin(self, readers: list[ShmReader], refs: list[SlotRef]) -> list[SlotRef] | None:
        for i, (reader, ref) in enumerate(zip(readers, refs)):
            if not reader.pin(ref):
                self._unpin(readers[:i], refs[:i])
                return None
        return refs

    @staticmethod
    def _unpin(readers: list[ShmReader], refs: list[SlotRef]) -> bool:
        """Let go of every pin; True when all of them stayed intact."""
        return all([reader.unpin(ref) for reader, ref in zip(readers, refs)])

    def _verified(
        self, readers: list[ShmReader], version: int, refs: list[SlotRef], expected: list[int], reject: Reject
    ) -> bool:
        at = 0
        for rank, (reader, ref, share) in enumerate(zip(readers, refs, self._shares)):
            count = len(share.buckets)
            bad = reader.mismatch(ref, expected[at : at + count]) if len(expected) >= at + count else 0
            if bad is not None:
                self._rejected = version
                a, b = share.buckets[bad]
                reject(version, f"checksum mismatch in trainer rank {rank}'s share, first bad bytes [{a}, {b})")
                return False
            at += count
        return True

    def newest_complete(self) -> int | None:
        """The newest version every ring holds complete (None: none, or a ring not readable yet)."""
        with self._held() as readers:
            common = {} if readers is None else self._common(readers)
        return max(common) if common else None

    def pending_above(self, held: int | None) -> bool:
        with self._held() as readers:
            return readers is not None and self._newest(readers, held, False) is not None

    def _markers(self) -> list[tuple[int, ...] | None]:
        with self._held() as readers:
            return [None] if readers is None else [r.change_marker() for r in readers]

    def wait_change(self, until: float, give_up: Callable[[], bool]) -> bool:
        """Until any rank's ring moves. Every trainer rank's own ring on this host wakes its readers when its
        share lands, so this waits on all of their wake-ups at once and reads the headers every _WOKEN_POLL_S
        besides (a lost wake-up); with a relay's host ring, or a ring without a wake-up socket, every _POLL_S."""
        try:
            seen = self._markers()
            poll_s = _WOKEN_POLL_S if self._all_woken() else _POLL_S
            while time.monotonic() < until and not give_up():
                self._wait(min(poll_s, max(0.0, until - time.monotonic())))
                if self._markers() != seen or self._idle.is_set():
                    break
        except (AttributeError, ValueError, IndexError, OSError):
            pass  # closed under us (a new sender epoch): the caller looks again
        return True

    def _all_woken(self) -> bool:
        """Every ring is a trainer rank's own (no stream leader swaps it) and wakes this reader."""
        if not self._lends:
            return False
        with self._held() as readers:
            return readers is not None and all(r.woken for r in readers)

    def _wait(self, timeout_s: float) -> None:
        """Until any ring's writer wakes this reader (each wakes its own ring's readers), or ``timeout_s``."""
        with self._held() as readers:
            if readers is not None and all(r.woken for r in readers):
                ShmReader.wait_any(readers, timeout_s)
                return
            if readers is not None:  # a ring without a wake-up socket: rank 0's wakes, the others are polled
                readers[0].wait(timeout_s)
                return
        self._idle.wait(timeout_s)

    def describe(self) -> str:
        ipc = 0
        for ring in self._rings:
            with ring.held() as reader:
                ipc += reader is not None and reader.device_copies
        how = f", {ipc} copied from the trainer's GPUs (CUDA IPC)" if ipc else ""
        return self._describe + how

    def close(self) -> None:
        self._idle.set()
        owned, self._owned = self._owned, []
        for closer in owned:
            closer()
        rings, self._rings = self._rings, []
        for ring in rings:
            ring.close()
        remove_stale_segments()  # a trainer rank SIGKILLed leaves its ring behind


def open_rank_rings(
    epoch: int, layout: Manifest, plan: ShardPlan, ordered: list[torch.Tensor], name: str
) -> ShardedSource:
    """Every trainer rank's own ring, all on this host."""
    shares = plan.share_layouts(layout)
    rings: list[ShareRing] = []
    try:
        for segment, share in zip(plan.segments, shares):
            rings.append(FixedRing(segment, share))
    except BaseException:
        for ring in rings:
            ring.close()
        raise
    return ShardedSource(epoch, layout, plan, shares, ordered, name, rings)
