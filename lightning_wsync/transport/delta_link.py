"""Deltas on a two-rank link: what each side holds, one encoding shared by every link, the wire.

The sender encodes version ``v`` against base ``b`` once (:class:`DeltaStream`), bucket by
bucket, and any number of links read the records as they appear, so the first link's
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
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lightning_wsync._manifest import Manifest, checksum
from lightning_wsync.config import DELTA_MODES
from lightning_wsync.transport.delta import (
    BucketDelta,
    DeltaDecoder,
    DeltaEncoder,
    DeltaError,
    DeltaHeader,
    base_digest,
    delta_hopeless,
    word_bytes_for,
)
from lightning_wsync.transport.group import PeerGroup, Work, to_int64
from lightning_wsync.transport.ring import Lease, SnapshotRing

log = logging.getLogger(__name__)

# "auto" sends a delta while the last one measured at most this share of the full
# version's bytes; above it, full versions for _AUTO_BACKOFF pushes, then it tries again.
AUTO_MAX_WIRE_SHARE = 0.5
_AUTO_BACKOFF = 8
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
        raw = json.loads(text or "")
        held = raw["held"]
        decode_s = raw["decode_s"]
        return (None if held is None else Held(int(held[0]), int(held[1]))), (
            None if decode_s is None else float(decode_s)
        )
    except (ValueError, TypeError, KeyError, IndexError):
        return None, None


@dataclass
class DeltaStats:
    """What one version's delta cost: the push report's per-link metrics."""

    changed_share: float = 0.0
    wire_bytes: int = 0
    full_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0


class EncoderPool:
    """A few :class:`DeltaEncoder` (each with its own scratch), so buckets encode in parallel."""

    def __init__(self, layout: Manifest, workers: int) -> None:
        self.layout = layout
        self._free = [DeltaEncoder(layout) for _ in range(max(1, workers))]
        self.workers = len(self._free)
        self._cond = threading.Condition()

    def encode(self, index: int, base: torch.Tensor, new: torch.Tensor) -> BucketDelta:
        with self._cond:
            self._cond.wait_for(lambda: bool(self._free))
            encoder = self._free.pop()
        try:
            return encoder.encode_bucket(index, base, new)
        finally:
            with self._cond:
                self._free.append(encoder)
                self._cond.notify()

    def header(self, *, version: int, base_version: int, base_sums: list[int]) -> DeltaHeader:
        with self._cond:
            self._cond.wait_for(lambda: bool(self._free))
            return self._free[0].header(version=version, base_version=base_version, base_sums=base_sums)


class DeltaStream:
    """Version ``version`` encoded against ``base_version``, once, for every link that needs it.

    Buckets are encoded in order, by the link that asks for them and by helper threads
    (one per extra encoder of the pool), so bucket ``i + 1`` encodes while bucket ``i``
    travels; a second link reading bucket ``i`` waits only for bucket ``i``. ``base`` and
    ``new`` must not be overwritten while the stream is being encoded (the sender's ring
    pins both while a link sends).
    """

    def __init__(
        self, pool: EncoderPool, *, version: int, base_version: int, base: torch.Tensor, new: torch.Tensor,
        base_sums: list[int],
    ) -> None:  # fmt: skip
        self.header = pool.header(version=version, base_version=base_version, base_sums=base_sums)
        self._pool = pool
        self._n = len(pool.layout.buckets)
        self._base, self._new = base, new
        self._records: dict[int, BucketDelta] = {}
        self._claimed = 0
        self._cond = threading.Condition()
        self._helpers: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._started: float | None = None
        self._finished: float | None = None

    @property
    def encode_s(self) -> float:
        """Wall time from the first bucket's encoding to the last's (all encoders together)."""
        if self._started is None:
            return 0.0
        return (self._finished or time.perf_counter()) - self._started

    def _encode_next(self) -> bool:
        """Claim and encode the next unclaimed bucket; False when none is left."""
        with self._cond:
            if self._claimed >= self._n:
                return False
            index = self._claimed
            self._claimed += 1
            if self._started is None:
                self._started = time.perf_counter()
        try:
            record = self._pool.encode(index, self._base, self._new)
        except BaseException as exc:
            with self._cond:
                self._error = exc
                self._cond.notify_all()
            raise
        with self._cond:
            self._records[index] = record
            if len(self._records) == self._n:
                self._finished = time.perf_counter()
            self._cond.notify_all()
        return True

    def _help(self) -> None:
        try:
            while self._encode_next():
                pass
        except BaseException as exc:  # noqa: BLE001 - kept in _error; the reader raises it
            log.debug("delta encoding helper of version %d failed: %s", self.header.version, exc)

    def record(self, index: int) -> BucketDelta:
        with self._cond:
            if not self._helpers and self._pool.workers > 1 and self._claimed == 0:
                name = f"wsync-delta-encode-{self.header.version}"
                self._helpers = [
                    threading.Thread(target=self._help, name=f"{name}-{i}", daemon=True)
                    for i in range(self._pool.workers - 1)
                ]
                for helper in self._helpers:
                    helper.start()
        while True:
            with self._cond:
                if self._error is not None:
                    raise RuntimeError(f"delta encoding failed: {self._error}") from self._error
                if index in self._records:
                    return self._records[index]
                if self._claimed > index:  # another thread is encoding it
                    self._cond.wait(0.1)
                    continue
            self._encode_next()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def join(self, timeout_s: float) -> None:
        for helper in self._helpers:
            helper.join(timeout_s)

    def stats(self) -> DeltaStats:
        """Totals over the buckets encoded so far (all of them once a link has sent the stream)."""
        with self._cond:
            records = list(self._records.values())
        words = self.header.total_bytes // self.header.word_bytes
        return DeltaStats(
            changed_share=sum(r.changed for r in records) / max(1, words),
            wire_bytes=DeltaHeader.SIZE + sum(len(r.payload) for r in records),
            full_bytes=self.header.total_bytes, encode_s=self.encode_s,
        )  # fmt: skip


class DeltaStreams:
    """The sender's streams, one per (base version, version), shared by its links; old ones dropped."""

    def __init__(self, layout: Manifest, *, keep: int = 2, workers: int = 2) -> None:
        self._layout = layout
        self._workers = workers
        self._pool: EncoderPool | None = None  # scratch allocated with the first network peer
        self._streams: dict[tuple[int, int], DeltaStream] = {}
        self._lock = threading.Lock()
        self._keep = keep

    def prepare(self) -> None:
        """Allocate (and fault in) the encoders' scratch now: called when a network peer appears,
        so the first delta does not pay for it."""
        with self._lock:
            if self._pool is None:
                self._pool = EncoderPool(self._layout, self._workers)

    def get(
        self, *, version: int, base_version: int, base: torch.Tensor, new: torch.Tensor, base_sums: list[int]
    ) -> DeltaStream:
        self.prepare()
        key = (base_version, version)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None or stream.failed:  # a failed encoding is not served again
                assert self._pool is not None
                stream = self._streams[key] = DeltaStream(
                    self._pool, version=version, base_version=base_version, base=base, new=new, base_sums=base_sums
                )
                for old in sorted(self._streams, key=lambda k: k[1])[: -self._keep]:
                    del self._streams[old]
            return stream

    def stats_for(self, version: int) -> DeltaStats | None:
        """The delta that carried ``version`` (to receivers that held the version before it, if several)."""
        with self._lock:
            streams = [s for (_, v), s in self._streams.items() if v == version]
        if not streams:
            return None
        return max((s.stats() for s in streams), key=lambda st: st.wire_bytes)

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait for helper threads still encoding (bounded)."""
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.join(timeout_s)


class AutoPolicy:
    """``delta="auto"``: keep sending deltas while they are clearly smaller than the full version.

    Decided once per version, so every link sends a version the same way.
    """

    def __init__(self, mode: str) -> None:
        assert mode in DELTA_MODES, mode  # validated by SenderConfig
        self.mode = mode
        self._full_left = 0  # versions still to send full after a delta that did not pay
        self._decided: dict[int, bool] = {}
        self._observed: set[int] = set()
        self._lock = threading.Lock()

    def want_delta(self, version: int) -> bool:
        if self.mode != "auto":
            return self.mode == "always"
        with self._lock:
            if version not in self._decided:
                self._decided[version] = self._full_left == 0
                self._full_left = max(0, self._full_left - 1)
                for old in sorted(self._decided)[:-8]:
                    del self._decided[old]
            return self._decided[version]

    def observe(self, version: int, stats: DeltaStats) -> None:
        """Feed back one version's delta size: too large, and the next pushes go out full."""
        with self._lock:
            if self.mode != "auto" or version in self._observed:
                return
            self._observed = {v for v in self._observed if v > version - 8} | {version}
            if stats.full_bytes and stats.wire_bytes > AUTO_MAX_WIRE_SHARE * stats.full_bytes:
                self._full_left = _AUTO_BACKOFF


def delta_base(
    ring: SnapshotRing, deltas: DeltaStreams | None, policy: AutoPolicy, held: Held | None, lease: Lease,
    peer: str,
) -> tuple[DeltaStream, Lease] | None:
    """The delta of ``lease``'s version against what ``peer`` holds, and a lease on that base.

    None (a full version goes out) when deltas are off or not worth it now, the peer
    holds nothing or something newer, or the ring no longer holds the exact bytes it
    holds. A peer that holds ``lease``'s version itself gets an empty delta.
    """  # fmt: skip
    version = lease.ref.version
    if deltas is None or held is None or held.version > version or lease.buffer.is_cuda:
        return None
    if not policy.want_delta(version):
        return None
    ref = ring.find(held.version)
    base = ring.acquire(ref) if ref is not None else None
    if base is None:
        log.debug("version %d to %s in full: base %d no longer in the ring (%s)", version, peer, held.version,
                  ring.describe())  # fmt: skip
        return None
    base_sums = ring.checksums(base)
    if base_sums is None or base_digest(base_sums) != held.digest:  # same number, other bytes (a restart)
        log.debug("version %d to %s in full: its %d is other bytes", version, peer, held.version)
        base.release()
        return None
    if policy.mode == "auto" and delta_hopeless(base.buffer, lease.buffer, word_bytes_for(ring.layout)):
        log.debug("version %d to %s in full: most words changed since %d", version, peer, held.version)
        base.release()
        return None
    stream = deltas.get(version=version, base_version=held.version, base=base.buffer, new=lease.buffer,
                        base_sums=base_sums)  # fmt: skip
    return stream, base


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

    ``progress`` is called after each bucket went out (the caller's leases stay valid).
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
            for work in in_flight.pop(0):
                work.wait()
            if progress is not None:
                progress()
    for works in in_flight:
        for work in works:
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

