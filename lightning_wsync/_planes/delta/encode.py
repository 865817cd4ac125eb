"""Deltas' encoding side, shared by every link of a sender: each version is encoded once
against each base a receiver holds (:class:`DeltaStream`), buckets in parallel
(:class:`EncoderPool`), and ``delta="auto"`` decides per version whether a delta is worth
sending at all (:class:`AutoPolicy`). The wire and what receivers hold are in
:mod:`~lightning_wsync._planes.delta.wire`.

Longer than 300 lines: the stream, its encoder pool and the auto policy share one sender's
buckets and bases; apart they would pass each other their state.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from lightning_wsync._control.manifest import Manifest
from lightning_wsync._planes.delta.codec import (
    BucketDelta,
    DeltaEncoder,
    DeltaHeader,
    base_digest,
    delta_hopeless,
    word_bytes_for,
)
from lightning_wsync._planes.delta.wire import DeltaStats, Held
from lightning_wsync._planes.shm.ring import Lease, SnapshotRing
from lightning_wsync.config import DELTA_MODES

log = logging.getLogger(__name__)

# "auto" sends a delta while the last one measured at most this share of the full
# version's bytes; above it, full versions for _AUTO_BACKOFF pushes, then it tries again.
AUTO_MAX_WIRE_SHARE = 0.5
_AUTO_BACKOFF = 8


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
        """Wait for the helpers, all of them within ``timeout_s`` (one bound, not one each)."""
        deadline = time.monotonic() + timeout_s
        for helper in self._helpers:
            helper.join(max(0.0, deadline - time.monotonic()))

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
    """The sender's streams, one per (base version, version, cut), shared by its links; old ones
    dropped. A stream's records are cut by the sender's buckets, or as :meth:`get`'s ``layout`` says."""

    def __init__(self, layout: Manifest, *, keep: int = 2, workers: int = 2) -> None:
        self._layout = layout
        self._workers = workers
        self._pools: dict[int, EncoderPool] = {}  # by the cut's bucket count; scratch allocated with the first peer
        self._streams: dict[tuple[int, int, int], DeltaStream] = {}
        self._lock = threading.Lock()
        self._keep = keep

    def prepare(self, layout: Manifest | None = None) -> EncoderPool:
        """Allocate (and fault in) the encoders' scratch for ``layout`` (the sender's by default)
        now: called when a network peer appears, so the first delta does not pay for it."""
        cut = self._layout if layout is None else layout
        with self._lock:
            pool = self._pools.get(len(cut.buckets))
            if pool is None:
                pool = self._pools[len(cut.buckets)] = EncoderPool(cut, self._workers)
            return pool

    def get(
        self, *, version: int, base_version: int, base: torch.Tensor, new: torch.Tensor, base_sums: list[int],
        layout: Manifest | None = None,
    ) -> DeltaStream:  # fmt: skip
        pool = self.prepare(layout)
        key = (base_version, version, len(pool.layout.buckets))
        with self._lock:
            stream = self._streams.get(key)
            if stream is None or stream.failed:  # a failed encoding is not served again
                stream = self._streams[key] = DeltaStream(
                    pool, version=version, base_version=base_version, base=base, new=new, base_sums=base_sums
                )
                for old in sorted(self._streams, key=lambda k: k[1])[: -self._keep * len(self._pools)]:
                    del self._streams[old]
            return stream

    def stats_for(self, version: int) -> DeltaStats | None:
        """The delta that carried ``version`` (to receivers that held the version before it, if several)."""
        with self._lock:
            streams = [s for (_, v, _), s in self._streams.items() if v == version]
        if not streams:
            return None
        return max((s.stats() for s in streams), key=lambda st: st.wire_bytes)

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait for helper threads still encoding, those of every stream within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.join(max(0.0, deadline - time.monotonic()))


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
        self._last_share: float | None = None  # the last delta's wire bytes / the full version's
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

    def wire_share(self) -> float:
        """The share of a full version's bytes the next versions are expected to cost on the
        wire: the last delta's, or 1.0 (deltas off, backing off, or none measured yet)."""
        with self._lock:
            if self.mode == "off" or self._full_left or self._last_share is None:
                return 1.0
            return self._last_share

    def observe(self, version: int, stats: DeltaStats) -> None:
        """Feed back one version's delta size: too large, and the next pushes go out full."""
        with self._lock:
            if stats.full_bytes:
                self._last_share = stats.wire_bytes / stats.full_bytes
            if self.mode != "auto" or version in self._observed:
                return
            self._observed = {v for v in self._observed if v > version - 8} | {version}
            if stats.full_bytes and stats.wire_bytes > AUTO_MAX_WIRE_SHARE * stats.full_bytes:
                self._full_left = _AUTO_BACKOFF


def delta_base(
    ring: SnapshotRing, deltas: DeltaStreams | None, policy: AutoPolicy, held: Held | None, lease: Lease,
    peer: str, layout: Manifest | None = None,
) -> tuple[DeltaStream, Lease] | None:
    """The delta of ``lease``'s version against what ``peer`` holds, and a lease on that base;
    its records cut as ``layout`` says (the ring's buckets by default).

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
                        base_sums=base_sums, layout=layout)  # fmt: skip
    return stream, base
