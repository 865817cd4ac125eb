"""Deltas on a two-rank link: what each side holds, one encoding shared by every link, the wire.

The sender encodes version ``v`` against base ``b`` once (:class:`DeltaStream`), bucket by
bucket, and any number of links read the records as they appear, so the first link's
send of bucket ``i`` overlaps the encoding of bucket ``i + 1``. On the wire a delta
follows the full version's header and precedes its trailer:

    per bucket: int64 [record bytes], then the record's bytes (uint8)

The receiver rebuilds each bucket as it arrives (into the buffer that holds the base,
or into another one), hashes it, and the full version's trailer decides, exactly as
for a full version. After every version the receiver reports what it holds
(:class:`Held`): the sender sends a delta only against that.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from lightning_wsync._manifest import Layout, checksum
from lightning_wsync.config import DELTA_MODES
from lightning_wsync.transport.delta import (
    BucketDelta,
    DeltaDecoder,
    DeltaEncoder,
    DeltaError,
    DeltaHeader,
    base_digest,
)

# "auto" sends a delta while the last one measured at most this share of the full
# version's bytes; above it, full versions for _AUTO_BACKOFF pushes, then it tries again.
AUTO_MAX_WIRE_SHARE = 0.5
_AUTO_BACKOFF = 8


class _Work(Protocol):
    def wait(self) -> bool: ...


class PeerGroup(Protocol):
    """What a link uses of a standalone two-rank gloo group."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> _Work: ...
    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> _Work: ...


class Held(NamedTuple):
    """The version a receiver holds intact, named by number and by its bucket checksums' digest."""

    version: int
    digest: int

    def to_words(self) -> list[int]:
        return [self.version, _signed(self.digest)]

    @staticmethod
    def from_words(words: list[int]) -> Held | None:
        return None if words[0] < 0 else Held(int(words[0]), int(words[1]) & (2**64 - 1))

    @staticmethod
    def none_words() -> list[int]:
        return [-1, 0]


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


class DeltaStream:
    """Version ``version`` encoded against ``base_version``, once, for every link that needs it.

    Records appear in bucket order as :meth:`record` asks for them; a second link
    reading bucket ``i`` waits only for bucket ``i``. ``base`` and ``new`` must not be
    overwritten while the stream lives (the sender's ring pins both).
    """

    def __init__(
        self, encoder: DeltaEncoder, encoder_lock: threading.Lock, *, version: int, base_version: int,
        base: torch.Tensor, new: torch.Tensor, base_sums: list[int],
    ) -> None:  # fmt: skip
        self.header = encoder.header(version=version, base_version=base_version, base_sums=base_sums)
        self._encoder = encoder
        self._encoder_lock = encoder_lock  # one encoder's scratch buffers, shared by every stream
        self._base, self._new = base, new
        self._records: list[BucketDelta] = []
        self._lock = threading.Lock()
        self.encode_s = 0.0

    @property
    def base_held(self) -> Held:
        return Held(self.header.base_version, self.header.base_digest)

    def record(self, index: int) -> BucketDelta:
        with self._lock:
            while len(self._records) <= index:
                start = time.perf_counter()
                with self._encoder_lock:
                    self._records.append(self._encoder.encode_bucket(len(self._records), self._base, self._new))
                self.encode_s += time.perf_counter() - start
            return self._records[index]

    def stats(self) -> DeltaStats:
        """Totals over the buckets encoded so far (all of them once a link has sent the stream)."""
        with self._lock:
            records = list(self._records)
        words = self.header.total_bytes // self.header.word_bytes
        return DeltaStats(
            changed_share=sum(r.changed for r in records) / max(1, words),
            wire_bytes=DeltaHeader.SIZE + sum(len(r.payload) for r in records),
            full_bytes=self.header.total_bytes, encode_s=self.encode_s,
        )  # fmt: skip


class DeltaStreams:
    """The sender's streams, one per (base version, version), shared by its links; old ones dropped."""

    def __init__(self, layout: Layout, *, keep: int = 2) -> None:
        self._encoder = DeltaEncoder(layout)
        self._encoder_lock = threading.Lock()
        self._streams: dict[tuple[int, int], DeltaStream] = {}
        self._lock = threading.Lock()
        self._keep = keep

    def get(
        self, *, version: int, base_version: int, base: torch.Tensor, new: torch.Tensor, base_sums: list[int]
    ) -> DeltaStream:
        key = (base_version, version)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                stream = self._streams[key] = DeltaStream(
                    self._encoder, self._encoder_lock, version=version, base_version=base_version, base=base,
                    new=new, base_sums=base_sums,
                )  # fmt: skip
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


def send_records(
    pg: PeerGroup, stream: DeltaStream, n_buckets: int, device: torch.device,
    progress: Callable[[], None] | None = None,
) -> None:
    """Every bucket's record: its size, then its bytes; the next bucket encodes while this one travels.

    ``progress`` is called after each bucket went out (the caller's leases stay valid).
    """  # fmt: skip
    header = torch.frombuffer(bytearray(stream.header.pack()), dtype=torch.uint8)
    pg.send([header.to(device)], 1, 0).wait()
    pending: list[_Work] = []
    for i in range(n_buckets):
        record = stream.record(i)
        size = torch.tensor([len(record.payload)], dtype=torch.int64)
        body = torch.frombuffer(bytearray(record.payload), dtype=torch.uint8)
        pending.append(pg.send([size.to(device)], 1, 0))
        pending.append(pg.send([body.to(device)], 1, 0))
        while len(pending) > 4:  # bounded: at most two buckets in flight
            pending.pop(0).wait()
            if progress is not None:
                progress()
    for work in pending:
        work.wait()
    if progress is not None:
        progress()


class Received(NamedTuple):
    """What a receiver got from a delta: the rebuilt buckets' checksums, or why it could not rebuild."""

    sums: list[int] | None  # None: rejected before or while rebuilding (error says why)
    error: str | None
    stats: DeltaStats


def recv_records(
    pg: PeerGroup, layout: Layout, *, held: Held | None, base: torch.Tensor | None, out: torch.Tensor,
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
        pg.recv([body], 0, 0).wait()
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
        sums.append(_signed(checksum(out, a, b)))
        stats.decode_s += time.perf_counter() - start
    if error is None and base is None:
        error = "no base buffer to rebuild from"
    if decoder is not None:
        stats.changed_share = changed / max(1, layout.total_bytes // decoder.header.word_bytes)
    return Received(None if error else sums, error, stats)


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u
