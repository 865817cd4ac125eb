"""The one check of a version received on any hop (a direct network link, a relay hop).

A version is accepted only when, in this order: the trailer's slot sequence equals the
header's (else the sender's slot was overwritten during the send, or an upstream leader
could not rebuild it: dropped without a rejection, the next version follows); the
trailer's MAC verifies with the job's secret; a delta was rebuilt; every bucket's
checksum computed here equals the trailer's. What the receiver then holds is named by
the trailer's checksums (the base of the next delta).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.store import Control
from lightning_wsync._planes.delta.wire import Held, held_of
from lightning_wsync._planes.wire import sums_mismatch, trailer_signed, trailer_words

log = logging.getLogger(__name__)


class Verdict(NamedTuple):
    """What became of one received version."""

    accepted: bool
    reason: str | None  # why it was rejected; None when accepted or dropped (overwritten during its send)
    held: Held | None  # accepted with checksums: what the buffer it was written into now holds


class Arrival(NamedTuple):
    """One version as it came in, for :func:`verify`."""

    version: int
    seq: int  # the slot sequence its header announced
    trailer: list[int]
    sums: list[int] | None  # checksums computed here; None: none can be (a CUDA buffer)
    delta_error: str | None  # why a delta could not be rebuilt


def verify(ctl: Control, layout: Manifest, *, epoch: int, rid: int, got: Arrival, where: str = "") -> Verdict:
    """Check ``got`` against its trailer, signed for (``epoch``, ``rid``); ``where`` goes into messages."""
    nb = len(layout.buckets)
    if len(got.trailer) != trailer_words(nb):
        raise RuntimeError(f"version {got.version}: a trailer of {len(got.trailer)} words; the hop is out of step")
    if got.trailer[0] != got.seq:
        log.debug("version %d%s was overwritten during its send, or not rebuilt upstream; waiting for the next",
                  got.version, where)  # fmt: skip
        return Verdict(False, None, None)
    sent, mac = got.trailer[1 : 1 + nb], got.trailer[1 + nb :]
    if not trailer_signed(ctl, epoch, rid, got.version, got.seq, sent, mac):
        return Verdict(False, f"trailer not signed with this job's secret{where} (secret= / WSYNC_SECRET)", None)
    if got.delta_error is not None:
        return Verdict(False, f"delta not applied{where} ({got.delta_error}); the next version comes in full", None)
    if got.sums is None:
        return Verdict(True, None, None)
    mismatch = sums_mismatch(layout.buckets, got.sums, sent, where=where)
    if mismatch is not None:
        return Verdict(False, mismatch, None)
    return Verdict(True, None, held_of(got.version, [s & (2**64 - 1) for s in sent]))
