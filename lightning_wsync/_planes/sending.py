"""What every plane's send side is built from (:class:`SendContext`): the sender's spec and
the snapshot ring, shared-memory segment and delta streams it feeds all its planes from.

Above ``shm`` and ``delta`` because it carries their objects; the shared-memory row, below it,
reads it through the two fields it needs (:class:`~lightning_wsync._planes.shm.open.RingSide`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import Timing
from lightning_wsync._planes.delta.encode import AutoPolicy, DeltaStreams
from lightning_wsync._planes.params import SenderSpec
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync._planes.shm.segment import ShmSegment


@dataclass(frozen=True, kw_only=True)
class SendContext:
    """What every plane's send side is built from: the sender's spec and the ring it feeds."""

    ctl: Control
    spec: SenderSpec
    ring: SnapshotRing
    segment: ShmSegment | None  # the ring's slots in shared memory (None: the ring is on the GPU)
    backend: str  # gloo | nccl
    timing: Timing
    deltas: DeltaStreams | None
    policy: AutoPolicy
