"""Deltas on a two-rank link: what each side holds, and the wire.

The sender encodes version ``v`` against base ``b`` once (``delta_encode.DeltaStream``),
bucket by bucket, and any number of links read the records as they appear, so the first link's
send of bucket ``i`` overlaps the encoding of bucket ``i + 1``. On the wire a delta
follows the full version's header and precedes its trailer:

    per bucket: int64 [record bytes], then the record's bytes (uint8, in pieces of 512 KiB)

The receiver rebuilds each bucket as it arrives (into the buffer that holds the base,
or into another one), hashes it, and the full version's trailer decides, exactly as
for a full version. After every version the receiver reports what it holds
(:class:`Held`): the sender sends a delta only against that.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from lightning_wsync._control.manifest import Manifest, checksum
from lightning_wsync._control.untrusted import load_json
from lightning_wsync._planes.base import DeltaStats as DeltaStats  # the plane interface's; kept importable here
from lightning_wsync._planes.delta.codec import (
    BucketDelta,
    DeltaDecoder,
    DeltaError,
    DeltaHeader,
    base_digest,
)
from lightning_wsync._planes.shm.ring import Lease, SnapshotRing
from lightning_wsync._planes.wire import PeerGroup, Work, to_int64

log = logging.getLogger(__name__)

RECORD_PIECE_BYTES = 1 << 19  # as the relay's chunks


class Held(NamedTuple):
    """The version a receiver holds intact, named by number and by its bucket checksums' digest."""

    version: int
    digest: int


def held_of(version: int, sums: list[int]) -> Held:
    return Held(version, base_digest(sums))


def ready_note(held: Held | None, decode_s: float | None) -> str:
    """What a receiver tells its link before each send: the version it holds, its last decode time."""
    return json.dumps({"held": None if held is None else [held.version, held.digest], "decode_s": decode_s})


def parse_ready_note(text: str | None) -> tuple[Held | None, float | None]:
    """Inverse of :func:`ready_note`; anything else (an older receiver's ``"1"``) holds nothing."""
    try:
        raw = load_json(text or "", "a ready note")  # unsigned: deep nesting is refused, not a RecursionError
        if not isinstance(raw, dict):
            return None, None
        held = raw["held"]
        decode_s = raw["decode_s"]
        return (None if held is None else Held(int(held[0]), int(held[1]))), (
            None if decode_s is None else float(decode_s)
        )
    except (ValueError, TypeError, KeyError, IndexError):
        return None, None


class DeltaStream(Protocol):
    """What a delta send reads (:class:`~lightning_wsync._planes.delta.encode.DeltaStream`):
    its header, then each bucket's record, in order."""

    @property
    def header(self) -> DeltaHeader: ...

    def record(self, index: int) -> BucketDelta: ...


def send_delta(
    pg: PeerGroup, ring: SnapshotRing, lease: Lease, stream: DeltaStream, base: Lease, name: str
) -> list[int] | None:
    """Send ``stream`` (``base`` to ``lease``'s version); return the full version's checksums for the trailer.

    None when either slot was overwritten meanwhile (the trailer then marks the version
    superseded). The checksums are computed by a helper thread while the records go out.
    """
    def progress() -> None:
        lease.touch()
        base.touch()

    hashed: list[list[int] | None] = []
    hasher = threading.Thread(target=lambda: hashed.append(ring.checksums(lease)), name=f"wsync-hash-{name}",
                              daemon=True)  # fmt: skip
    hasher.start()
    try:
        send_records(pg, stream, len(ring.layout.buckets), lease.buffer.device, progress=progress)
    finally:
        hasher.join()
    return hashed[0] if hashed and base.intact() else None


def send_records(
    pg: PeerGroup, stream: DeltaStream, n_buckets: int, device: torch.device,
    progress: Callable[[], None] | None = None,
) -> None:
    """Every bucket's record: its size, then its bytes; the next bucket encodes while this one travels.

    ``progress`` is called after each piece went out (the caller's leases stay valid).
    """  # fmt: skip
    header = torch.frombuffer(bytearray(stream.header.pack()), dtype=torch.uint8)
    pg.send([header.to(device)], 1, 0).wait()
    in_flight: list[list[Work]] = []
    for i in range(n_buckets):
        record = stream.record(i)
        size = torch.tensor([len(record.payload)], dtype=torch.int64)
        body = torch.frombuffer(bytearray(record.payload), dtype=torch.uint8).to(device)
        works = [pg.send([size.to(device)], 1, 0)]
        works += [pg.send([body[a:b]], 1, 0) for a, b in record_pieces(body.numel())]
        in_flight.append(works)
        while len(in_flight) > 2:  # bounded: at most two buckets in flight
            _drain(in_flight.pop(0), progress)
    for works in in_flight:
        _drain(works, progress)


def _drain(works: list[Work], progress: Callable[[], None] | None) -> None:
    for work in works:  # progress after every piece: a slow link that still moves keeps its leases
        work.wait()
        if progress is not None:
            progress()


def record_pieces(n: int) -> list[tuple[int, int]]:
    """A record's bytes travel in pieces of at most RECORD_PIECE_BYTES: a relay leader forwards
    each piece as it arrives, so a large record (a literal bucket) pipelines across hops."""
    return [(a, min(n, a + RECORD_PIECE_BYTES)) for a in range(0, n, RECORD_PIECE_BYTES)]


class Received(NamedTuple):
    """What a receiver got from a delta: the rebuilt buckets' checksums, or why it could not rebuild."""

    sums: list[int] | None  # None: rejected before or while rebuilding (error says why)
    error: str | None
    stats: DeltaStats


def recv_records(
    pg: PeerGroup, layout: Manifest, *, held: Held | None, base: torch.Tensor | None, out: torch.Tensor,
) -> Received:
    """Receive a delta and rebuild it into ``out`` from ``base`` (may be ``out`` itself).

    Always drains the whole delta so the link stays in step, even when the base does
    not match or a record is malformed; ``out`` is then not a valid version.
    """  # fmt: skip
    raw_header = torch.empty(DeltaHeader.SIZE, dtype=torch.uint8)
    pg.recv([raw_header], 0, 0).wait()
    stats = DeltaStats(full_bytes=layout.total_bytes)
    error: str | None = None
    decoder: DeltaDecoder | None = None
    try:
        header = DeltaHeader.unpack(raw_header.numpy().tobytes())
        decoder = DeltaDecoder(layout, header, held_version=None if held is None else held.version,
                               held_digest=None if held is None else held.digest)  # fmt: skip
    except DeltaError as exc:
        error = str(exc)
    stats.wire_bytes = DeltaHeader.SIZE
    sums: list[int] = []
    changed = 0
    for i in range(len(layout.buckets)):
        size = torch.empty(1, dtype=torch.int64)
        pg.recv([size], 0, 0).wait()
        n = int(size[0])
        if not 0 < n <= layout.buckets[i][1] - layout.buckets[i][0] + 64:  # a literal record: bucket + header
            raise RuntimeError(f"delta record {i} claims {n} bytes; the link is out of step")
        body = torch.empty(n, dtype=torch.uint8)
        for work in [pg.recv([body[a:b]], 0, 0) for a, b in record_pieces(n)]:
            work.wait()
        stats.wire_bytes += 8 + n
        if decoder is None or base is None:
            continue
        start = time.perf_counter()
        try:
            decoded = decoder.decode_bucket(body.numpy().tobytes(), base, out)
            if decoded.bucket != i:
                raise DeltaError(f"delta record {i} names bucket {decoded.bucket}")
            changed += decoded.changed
        except DeltaError as exc:
            error, decoder = str(exc), None
            continue
        a, b = layout.buckets[i]
        sums.append(to_int64(checksum(out, a, b)))
        stats.decode_s += time.perf_counter() - start
    if error is None and base is None:
        error = "no base buffer to rebuild from"
    if decoder is not None:
        stats.changed_share = changed / max(1, layout.total_bytes // decoder.header.word_bytes)
    return Received(None if error else sums, error, stats)

