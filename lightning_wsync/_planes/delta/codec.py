"""Lossless deltas between two versions of one :class:`~lightning_wsync._control.manifest.Manifest`.

A delta turns the receiver's copy of version ``base`` into version ``v``, bucket by
bucket, so buckets can be encoded, sent, relayed and decoded as a pipeline. The buffer
is read as words of the wire dtype's width (2 bytes for bf16/fp16); per bucket, the
words that differ are coded as

* the run of unchanged words before each changed one (one byte; runs of 255 or more
  as an escape byte plus a uint32 at the end),
* the XOR of old and new bits (split into byte planes: all low bytes, then all high),

both compressed together with zstd. Measured on GPT-2-sized AdamW steps in bf16 (see
``lightning-wsync bench --delta``): the XOR's high byte is almost always zero (sign and
exponent rarely move), so the XOR planes compress ~3x better than the new bits, and
the run planes are mostly zeros. A bucket that changed almost everywhere travels as
its raw bytes (mode ``LITERAL``), so a delta is never much larger than a full version.

The delta itself carries no per-byte integrity: the receiver rebuilds the full
version and checks it against the sender's per-bucket checksums of that version
(:func:`~lightning_wsync._control.manifest.checksum`), exactly as for a full version. The
header names the base version and a digest of the base's bucket checksums, so a
receiver that holds anything else refuses the delta before touching its buffer
(:class:`DeltaBaseMismatch`) and asks for a full version instead.

Longer than 300 lines: the record format, its encoder and its decoder agree byte for byte, read side by side.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash
import zstandard

from lightning_wsync._control.manifest import Manifest
from lightning_wsync.errors import WeightSyncError

__all__ = [
    "BucketDelta",
    "Decoded",
    "DeltaBaseMismatch",
    "DeltaDecoder",
    "DeltaEncoder",
    "DeltaError",
    "DeltaHeader",
    "base_digest",
    "delta_hopeless",
    "sampled_changed_share",
    "word_bytes_for",
]

UNCHANGED, SPARSE, LITERAL = 0, 1, 2
_MODES = (UNCHANGED, SPARSE, LITERAL)
_MAGIC = b"WSDELTA1"
_HEADER = struct.Struct("<8sqqQIIQ")  # magic, version, base version, base digest, word bytes, buckets, total bytes
_RECORD = struct.Struct("<IBQQ")  # bucket index, mode, changed words, long runs
_ESCAPE = 255  # a run of >= 255 unchanged words: this byte, and the run as uint32 after the XOR planes
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_WORDS: dict[int, type[np.unsignedinteger[Any]]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# A bucket where more than this share of words changed goes out raw without trying the
# sparse coding: its runs and XORs (>= 1 + word bytes per change before compression)
# would not be clearly smaller than the bucket.
_LITERAL_SHARE = 0.5
_SAMPLE_STRIDE = 4096  # bytes between the words sampled by sampled_changed_share
# Above this share of changed 8-byte groups, changed words are found word by word (one
# pass fewer than through the groups when most groups changed anyway).
_DENSE_GROUPS = 0.25


class DeltaError(WeightSyncError):
    """A delta is malformed (bad header or record); the receiver keeps what it holds."""


class DeltaBaseMismatch(DeltaError):
    """The delta was made against a version the receiver does not hold; it needs a full version."""


def base_digest(sums: Sequence[int]) -> int:
    """Digest of a version's per-bucket checksums: names the exact bytes a delta was made against."""
    return int(xxhash.xxh3_64_intdigest(struct.pack(f"<{len(sums)}Q", *(s & (2**64 - 1) for s in sums))))


def sampled_changed_share(base: torch.Tensor, new: torch.Tensor, word_bytes: int) -> float:
    """The share of words that differ between two flat byte buffers, from one word in every
    ``_SAMPLE_STRIDE`` bytes (16K words of a 64 MiB version: well under a millisecond)."""
    n = min(base.numel(), new.numel()) // word_bytes * word_bytes
    step = max(1, _SAMPLE_STRIDE // word_bytes)
    a = base[:n].view(_WORD_DTYPES[word_bytes])[::step]
    b = new[:n].view(_WORD_DTYPES[word_bytes])[::step]
    return float((a != b).sum()) / a.numel() if a.numel() else 0.0


def delta_hopeless(base: torch.Tensor, new: torch.Tensor, word_bytes: int) -> bool:
    """Whether so many words changed that every bucket would go out raw (fp32 weights after
    an optimizer step): a full version is then sent without encoding a delta first."""
    return sampled_changed_share(base, new, word_bytes) > _LITERAL_SHARE


def word_bytes_for(layout: Manifest) -> int:
    """The element width that covers most of the layout's bytes (2 for a bf16 wire dtype)."""
    by_width: dict[int, int] = {}
    for e in layout.entries:
        width = torch.empty((), dtype=e.wire_dtype).element_size()
        by_width[width] = by_width.get(width, 0) + e.nbytes
    width = max(by_width, key=lambda w: (by_width[w], w)) if by_width else 1
    return width if width in _WORD_DTYPES else 1


@dataclass(frozen=True)
class DeltaHeader:
    """What a delta turns into what: version ``base_version`` (exactly these bytes) into ``version``."""

    version: int
    base_version: int
    base_digest: int
    word_bytes: int
    n_buckets: int
    total_bytes: int

    SIZE = _HEADER.size

    def pack(self) -> bytes:
        return _HEADER.pack(
            _MAGIC, self.version, self.base_version, self.base_digest, self.word_bytes, self.n_buckets,
            self.total_bytes,
        )  # fmt: skip

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> DeltaHeader:
        if len(data) != _HEADER.size:
            raise DeltaError(f"delta header has {len(data)} bytes, expected {_HEADER.size}")
        magic, version, base_version, digest, word, n_buckets, total = _HEADER.unpack(data)
        if magic != _MAGIC:
            raise DeltaError(f"delta header starts with {magic!r}, expected {_MAGIC!r} (not a delta, or corrupted)")
        return cls(version, base_version, digest, word, n_buckets, total)

    def check(self, layout: Manifest, held_version: int | None, held_digest: int | None) -> None:
        """Raise unless this delta applies to ``layout`` and to the version held (its digest)."""
        if self.word_bytes not in _WORD_DTYPES:
            raise DeltaError(f"delta word size {self.word_bytes!r} is not one of {sorted(_WORD_DTYPES)}")
        if self.total_bytes != layout.total_bytes or self.n_buckets != len(layout.buckets):
            raise DeltaError(
                f"delta for version {self.version} is laid out as {self.total_bytes} bytes in {self.n_buckets} "
                f"buckets, this layout has {layout.total_bytes} bytes in {len(layout.buckets)}"
            )
        if held_version != self.base_version or held_digest != self.base_digest:
            raise DeltaBaseMismatch(
                f"delta for version {self.version} needs base version {self.base_version} "
                f"(digest {self.base_digest:#018x}); this side holds version {held_version!r} "
                f"(digest {'none' if held_digest is None else f'{held_digest:#018x}'}); a full version is needed"
            )


class BucketDelta(NamedTuple):
    """One bucket's record: ``payload`` is what travels (record header included)."""

    bucket: int
    mode: int
    changed: int  # words that differ from the base
    payload: bytes


class Decoded(NamedTuple):
    """What :meth:`DeltaDecoder.decode_bucket` rebuilt."""

    bucket: int
    mode: int
    changed: int


class DeltaEncoder:
    """Encodes buckets of ``new`` against ``base``; reuses its scratch buffers across calls.

    Not thread-safe: one encoder per thread. Scratch: a byte per word of the largest
    bucket (half the bucket in bf16), plus ~7 bytes per changed word of the largest
    sparse bucket seen, grown on demand; while a bucket encodes, ~35 bytes per changed
    word in temporaries (at 5% of bf16 words changed, 0.9x the bucket).
    """

    def __init__(self, layout: Manifest, *, word_bytes: int | None = None, level: int = 1) -> None:
        self.layout = layout
        self.word_bytes = word_bytes_for(layout) if word_bytes is None else word_bytes
        if self.word_bytes not in _WORD_DTYPES:
            raise ValueError(f"word_bytes={self.word_bytes!r} must be one of {sorted(_WORD_DTYPES)}")
        self._np_word = _NP_WORDS[self.word_bytes]
        largest = max((b - a for a, b in layout.buckets), default=0) // self.word_bytes
        if largest >= 2**31:
            raise ValueError(f"a bucket of {largest} words is too large for delta coding; lower bucket_mb")
        self._mask = np.zeros(largest, dtype=np.bool_)
        self._mask.fill(False)  # fault the pages in now, not during the first push
        self._capacity = 0
        self._grow(largest // 32)
        self._zstd = zstandard.ZstdCompressor(level=level)

    def _grow(self, k: int) -> None:
        """Scratch for ``k`` changed words (runs, byte planes)."""
        if k <= self._capacity:
            return
        k = max(k, self._capacity + self._capacity // 4)
        self._runs = np.zeros(k, dtype=np.int32)
        self._planes = np.zeros(k * (1 + self.word_bytes), dtype=np.uint8)
        for scratch in (self._runs, self._planes):
            scratch.fill(0)
        self._capacity = k

    def header(self, *, version: int, base_version: int, base_sums: Sequence[int]) -> DeltaHeader:
        """The header of a delta from ``base_version`` (whose bucket checksums are ``base_sums``)."""
        return DeltaHeader(
            version, base_version, base_digest(base_sums), self.word_bytes, len(self.layout.buckets),
            self.layout.total_bytes,
        )  # fmt: skip

    def encode_bucket(self, index: int, base: torch.Tensor, new: torch.Tensor) -> BucketDelta:
        """Record of bucket ``index`` taking ``base`` (flat uint8, CPU) to ``new``."""
        a, b = self.layout.buckets[index]
        old_bytes, new_bytes = base[a:b].numpy(), new[a:b].numpy()
        n_words = (b - a) // self.word_bytes
        found = self._changes(old_bytes, new_bytes, n_words)
        if found is None:
            mask = self._mask[:n_words]
            np.not_equal(new_bytes.view(self._np_word), old_bytes.view(self._np_word), out=mask)
            return self._literal(index, int(np.count_nonzero(mask)), new)
        positions, xor = found
        k = positions.size
        if k == 0:
            return BucketDelta(index, UNCHANGED, 0, _RECORD.pack(index, UNCHANGED, 0, 0))
        self._grow(k)
        runs = self._runs[:k]  # unchanged words before each change
        runs[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=runs[1:], casting="unsafe")  # < 2**31: checked above
        runs[1:] -= 1
        is_long = self._mask[:k]  # the change mask is no longer needed
        np.greater_equal(runs, _ESCAPE, out=is_long)
        long_runs = runs[np.flatnonzero(is_long)].astype("<u4")
        w = self.word_bytes
        raw = self._planes[: k * (1 + w)]
        np.minimum(runs, _ESCAPE, out=runs)
        np.copyto(raw[:k], runs, casting="unsafe")
        _split(xor, raw[k:].reshape(w, k))
        if long_runs.size:
            raw = np.concatenate([raw, long_runs.view(np.uint8)])
        body = self._zstd.compress(raw.data)
        if len(body) >= b - a:
            return self._literal(index, k, new)
        return BucketDelta(index, SPARSE, k, _RECORD.pack(index, SPARSE, k, long_runs.size) + body)

    def _changes(
        self, old_bytes: np.ndarray, new_bytes: np.ndarray, n_words: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Positions of the changed words and the XOR of their bits; None when most words changed.

        Compared 8 bytes at a time first: finding the few changed uint64 groups, then the
        changed words inside them, scans a mask a quarter the size (bf16) and gathers
        both versions once, about 1.5x faster than a word mask at a few percent changed.
        """
        per_group = 8 // self.word_bytes
        if old_bytes.size % 8 or old_bytes.ctypes.data % 8 or new_bytes.ctypes.data % 8 or per_group == 1:
            return self._word_changes(old_bytes, new_bytes, n_words)  # not seen with the layout's alignment
        old_g, new_g = old_bytes.view(np.uint64), new_bytes.view(np.uint64)
        mask = self._mask[: old_g.size]
        np.not_equal(new_g, old_g, out=mask)
        if np.count_nonzero(mask) > _DENSE_GROUPS * old_g.size:
            return self._word_changes(old_bytes, new_bytes, n_words)
        groups = np.flatnonzero(mask)
        xor_g = np.take(old_g, groups)
        xor_g ^= np.take(new_g, groups)
        xor_w = xor_g.view(self._np_word)  # little-endian: word j of a group sits at group * per_group + j
        mask = self._mask[: xor_w.size]  # the group mask is no longer needed
        np.not_equal(xor_w, 0, out=mask)
        inner = np.flatnonzero(mask)  # a bool mask: far faster to scan than the words themselves
        shift = per_group.bit_length() - 1
        positions = groups[inner >> shift]
        positions <<= shift
        positions += inner & (per_group - 1)
        return positions, xor_w[inner]

    def _word_changes(
        self, old_bytes: np.ndarray, new_bytes: np.ndarray, n_words: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        old_w, new_w = old_bytes.view(self._np_word), new_bytes.view(self._np_word)
        mask = self._mask[:n_words]
        np.not_equal(new_w, old_w, out=mask)
        if np.count_nonzero(mask) > _LITERAL_SHARE * n_words:
            return None
        positions = np.flatnonzero(mask)
        return positions, np.take(old_w, positions) ^ np.take(new_w, positions)

    def _literal(self, index: int, changed: int, new: torch.Tensor) -> BucketDelta:
        a, b = self.layout.buckets[index]
        record = _RECORD.pack(index, LITERAL, changed, 0) + new[a:b].numpy().tobytes()
        return BucketDelta(index, LITERAL, changed, record)

    def encode(self, base: torch.Tensor, new: torch.Tensor) -> list[BucketDelta]:
        """Every bucket's record, in layout order."""
        return [self.encode_bucket(i, base, new) for i in range(len(self.layout.buckets))]


class DeltaDecoder:
    """Applies bucket records to a buffer that holds the base (in place or into ``out``).

    Raises:
        DeltaError, DeltaBaseMismatch: from :meth:`DeltaHeader.check`, before any byte is written.
    """

    def __init__(
        self, layout: Manifest, header: DeltaHeader, *, held_version: int | None, held_digest: int | None
    ) -> None:
        header.check(layout, held_version, held_digest)
        self.layout = layout
        self.header = header
        self._zstd = zstandard.ZstdDecompressor()

    def decode_bucket(
        self, payload: bytes | bytearray | memoryview, base: torch.Tensor, out: torch.Tensor
    ) -> Decoded:
        """Write the new bucket into ``out`` (may be ``base`` itself); returns which bucket and how.

        Raises:
            DeltaError: the record is malformed (bad index, mode, size or positions).
                ``out``'s bucket may then hold partial bytes; the caller verifies
                checksums anyway and must treat that bucket as lost.
        """
        view = memoryview(payload)
        if len(view) < _RECORD.size:
            raise DeltaError(f"delta record of {len(view)} bytes is shorter than its {_RECORD.size}-byte header")
        index, mode, changed, n_long = _RECORD.unpack(view[: _RECORD.size])
        body = view[_RECORD.size :]
        if index >= len(self.layout.buckets):
            raise DeltaError(f"delta record names bucket {index}, the layout has {len(self.layout.buckets)}")
        if mode not in _MODES:
            raise DeltaError(f"delta record for bucket {index} has unknown mode {mode}")
        a, b = self.layout.buckets[index]
        word = self.header.word_bytes
        n_words = (b - a) // word
        if changed > n_words:
            raise DeltaError(f"delta record for bucket {index} claims {changed} changed words of {n_words}")
        if mode == LITERAL:
            if len(body) != b - a:
                raise DeltaError(f"literal record for bucket {index} has {len(body)} bytes, the bucket {b - a}")
            out[a:b].numpy()[:] = np.frombuffer(body, dtype=np.uint8)
            return Decoded(int(index), mode, int(changed))
        if out.data_ptr() != base.data_ptr():
            out[a:b].copy_(base[a:b])
        if mode == UNCHANGED:
            if len(body) or changed:
                raise DeltaError(f"unchanged record for bucket {index} carries {len(body)} bytes, {changed} changes")
            return Decoded(int(index), mode, 0)
        if changed == 0:
            raise DeltaError(f"sparse record for bucket {index} lists no changes")
        if n_long > changed:
            raise DeltaError(f"sparse record for bucket {index} claims {n_long} long runs for {changed} changes")
        data = self._inflate(index, body, changed * (1 + word) + 4 * n_long)
        short = data[:changed]
        positions = short.astype(np.int64)
        escaped = np.flatnonzero(short == _ESCAPE)
        if escaped.size != n_long:
            raise DeltaError(f"sparse record for bucket {index} has {escaped.size} escaped runs, header says {n_long}")
        positions[escaped] = data[changed * (1 + word) :].view("<u4")
        positions += 1
        np.cumsum(positions, out=positions)
        positions -= 1
        if int(positions[-1]) >= n_words:  # runs are unsigned, so positions only grow
            raise DeltaError(f"sparse record for bucket {index} points past its {n_words} words")
        planes = data[changed : changed * (1 + word)].reshape(word, changed)
        xor = _join(planes, np.empty(changed, dtype=_NP_WORDS[word]))
        words = out[a:b].numpy().view(_NP_WORDS[word])
        words[positions] ^= xor
        return Decoded(int(index), mode, int(changed))


    def _inflate(self, index: int, body: memoryview, expected: int) -> np.ndarray:
        """A sparse record's body decompressed: exactly ``expected`` bytes, or DeltaError."""
        try:
            # python-zstandard ignores max_output_size when the frame declares its size, and
            # allocates what it declares: a 2 KiB frame could ask for 64 MiB before the trailer's MAC is checked.
            declared = zstandard.get_frame_parameters(body).content_size
            if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > expected:
                raise DeltaError(f"sparse record for bucket {index} does not decompress: its frame declares "
                                 f"{declared} bytes, its record header allows {expected}; refused unread")  # fmt: skip
            raw = self._zstd.decompress(body, max_output_size=expected)
        except zstandard.ZstdError as exc:
            raise DeltaError(f"sparse record for bucket {index} does not decompress: {exc}") from exc
        if len(raw) != expected:
            raise DeltaError(f"sparse record for bucket {index} holds {len(raw)} bytes, expected {expected}")
        return np.frombuffer(raw, dtype=np.uint8)


def _split(values: np.ndarray, planes: np.ndarray) -> None:
    """Byte planes of ``values`` into the rows of ``planes``: all lowest bytes first.

    Strided byte copies rather than shifts: one pass per plane. Byte order is the
    machine's; every platform torch ships for is little-endian.
    """
    width = planes.shape[0]
    as_bytes = values.view(np.uint8)
    for j in range(width):
        np.copyto(planes[j], as_bytes[j::width])


def _join(planes: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_split`: ``out`` from its byte planes."""
    width = planes.shape[0]
    as_bytes = out.view(np.uint8)
    for j in range(width):
        as_bytes[j::width] = planes[j]
    return out
