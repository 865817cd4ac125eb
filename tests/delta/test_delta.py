"""Unit tests of the delta codec: bit-exact round trips, refusals, corruption caught."""

from __future__ import annotations

import struct

import pytest
import torch

from lightning_wsync._control.manifest import (
    Manifest,
    build_manifest,
    checksum,
    copy_into,
    select_tensors,
)
from lightning_wsync._planes.delta.codec import (
    LITERAL,
    SPARSE,
    UNCHANGED,
    DeltaBaseMismatch,
    DeltaDecoder,
    DeltaEncoder,
    DeltaError,
    DeltaHeader,
    base_digest,
    word_bytes_for,
)

_RECORD = "<IBQQ"  # bucket, mode, changed words, long runs
_RECORD_BYTES = struct.calcsize(_RECORD)


def _layout(wire: torch.dtype | None, *, bucket_bytes: int = 4096) -> tuple[Manifest, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "emb": torch.randn(300, 16, generator=g) * 0.02,
        "w": torch.randn(64, 40, generator=g) * 0.02,
        "b": torch.zeros(40),
        "ln": torch.ones(40),
        "steps": torch.arange(5, dtype=torch.int64),  # never cast: mixed widths in one layout
    }
    return build_manifest(tensors, wire, bucket_bytes), tensors


def _snapshot(layout: Manifest, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    copy_into(layout, buffer, tensors.values())
    return buffer


def _sums(layout: Manifest, buffer: torch.Tensor) -> list[int]:
    return [checksum(buffer, a, b) for a, b in layout.buckets]


def _round_trip(layout: Manifest, base: torch.Tensor, new: torch.Tensor, *, in_place: bool = True) -> tuple[
    torch.Tensor, list[int]
]:
    enc = DeltaEncoder(layout)
    header = enc.header(version=8, base_version=7, base_sums=_sums(layout, base))
    records = enc.encode(base, new)
    wire = DeltaHeader.unpack(header.pack())
    dec = DeltaDecoder(layout, wire, held_version=7, held_digest=base_digest(_sums(layout, base)))
    held = base.clone()
    out = held if in_place else torch.full_like(base, 0xAB)
    for r in records:
        assert dec.decode_bucket(r.payload, held, out) == (r.bucket, r.mode, r.changed)
    return out, [r.mode for r in records]


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16, None], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("share", [0.0, 0.001, 0.05, 0.3, 1.0])
def test_round_trip_is_bit_exact_for_every_wire_dtype_and_share(wire: torch.dtype | None, share: float) -> None:
    layout, tensors = _layout(wire)
    base = _snapshot(layout, tensors)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in tensors.values():
            if t.is_floating_point():
                hit = torch.rand(t.shape, generator=g) < share
                t.add_(torch.where(hit, torch.randn(t.shape, generator=g) * 0.01, torch.zeros(t.shape)))
    new = _snapshot(layout, tensors)
    for in_place in (True, False):
        out, modes = _round_trip(layout, base, new, in_place=in_place)
        assert torch.equal(out, new)
        assert _sums(layout, out) == _sums(layout, new)
    if share == 0.0:
        assert modes == [UNCHANGED] * len(layout.buckets)
    if share == 1.0:
        assert modes[0] == LITERAL  # every word changed: raw bytes, never larger
    if share == 0.05 and wire is not None:
        assert SPARSE in modes


@pytest.mark.parametrize("word_bytes", [1, 2, 4, 8])
@pytest.mark.parametrize("share", [0.002, 0.03, 0.2, 0.6])
def test_changed_words_found_through_8_byte_groups_match_a_word_by_word_count(word_bytes: int, share: float) -> None:
    """Sparse buckets are searched 8 bytes at a time, dense ones word by word: same changes either way."""
    layout, tensors = _layout(torch.bfloat16)
    base = _snapshot(layout, tensors)
    g = torch.Generator().manual_seed(2)
    new = base.clone()
    hit = torch.rand(layout.total_bytes, generator=g) < share / word_bytes  # bytes hit: ~share of the words
    new[hit] ^= torch.randint(1, 256, (int(hit.sum()),), dtype=torch.uint8, generator=g)
    enc = DeltaEncoder(layout, word_bytes=word_bytes)
    header = enc.header(version=2, base_version=1, base_sums=_sums(layout, base))
    dec = DeltaDecoder(layout, header, held_version=1, held_digest=header.base_digest)
    out = base.clone()
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[word_bytes]
    for record in enc.encode(base, new):
        a, b = layout.buckets[record.bucket]
        assert record.changed == int((base[a:b].view(dtype) != new[a:b].view(dtype)).sum())
        dec.decode_bucket(record.payload, out, out)
    assert torch.equal(out, new)


def test_structured_changes_first_last_and_consecutive_words() -> None:
    layout, tensors = _layout(torch.bfloat16, bucket_bytes=1 << 20)
    assert len(layout.buckets) == 1
    base = _snapshot(layout, tensors)
    new = base.clone()
    words = new.view(torch.int16)
    words[0] ^= 1
    words[-1] ^= 0x7FFF  # padding bytes at the end are part of the bucket too
    words[100:164] += 3  # a run of changes: runs of zero
    words[5000] = -words[5000]
    out, modes = _round_trip(layout, base, new)
    assert modes == [SPARSE]
    assert torch.equal(out, new)


def test_long_runs_between_changes_round_trip() -> None:
    layout, tensors = _layout(torch.bfloat16, bucket_bytes=1 << 20)
    base = _snapshot(layout, tensors)
    new = base.clone()
    words = new.view(torch.int16)
    for pos in (254, 255 + 254 + 1, 70000 % words.numel(), words.numel() - 1):  # runs of 254, 255, long
        words[pos] ^= 2
    out, modes = _round_trip(layout, base, new)
    assert modes == [SPARSE]
    assert torch.equal(out, new)


def test_only_changed_words_travel_and_small_changes_compress() -> None:
    layout, tensors = _layout(torch.bfloat16, bucket_bytes=1 << 20)
    base = _snapshot(layout, tensors)
    new = base.clone()
    idx = torch.arange(0, layout.total_bytes // 2, 50)  # 2% of the words, each one ulp up
    new.view(torch.int16)[idx] += 1
    enc = DeltaEncoder(layout)
    (record,) = enc.encode(base, new)
    assert record.changed == idx.numel()
    # uncompressed: 1 byte of run + 2 of XOR per change; constant runs and XORs compress
    assert len(record.payload) < 0.3 * idx.numel() * 3
    out, _ = _round_trip(layout, base, new)
    assert torch.equal(out, new)


def test_word_width_follows_the_wire_dtype() -> None:
    assert word_bytes_for(_layout(torch.bfloat16)[0]) == 2
    assert word_bytes_for(_layout(None)[0]) == 4
    with pytest.raises(ValueError, match=r"word_bytes=3 must be one of \[1, 2, 4, 8\]"):
        DeltaEncoder(_layout(None)[0], word_bytes=3)


def test_header_round_trips_and_refuses_another_base() -> None:
    layout, tensors = _layout(torch.bfloat16)
    base = _snapshot(layout, tensors)
    sums = _sums(layout, base)
    header = DeltaEncoder(layout).header(version=8, base_version=7, base_sums=sums)
    assert DeltaHeader.unpack(header.pack()) == header
    assert len(header.pack()) == DeltaHeader.SIZE
    digest = base_digest(sums)
    DeltaDecoder(layout, header, held_version=7, held_digest=digest)  # accepted
    with pytest.raises(DeltaBaseMismatch, match=r"needs base version 7 .* holds version 6 .* a full version is needed"):
        DeltaDecoder(layout, header, held_version=6, held_digest=digest)
    with pytest.raises(DeltaBaseMismatch, match=r"holds version None \(digest none\)"):
        DeltaDecoder(layout, header, held_version=None, held_digest=None)
    other = base.clone()
    other[0] ^= 1  # same version number, different bytes (e.g. a restarted sender)
    with pytest.raises(DeltaBaseMismatch, match="needs base version 7"):
        DeltaDecoder(layout, header, held_version=7, held_digest=base_digest(_sums(layout, other)))
    bigger, _ = _layout(torch.bfloat16, bucket_bytes=1 << 20)
    with pytest.raises(DeltaError, match=r"laid out as \d+ bytes in \d+ buckets, this layout has \d+ bytes in 1"):
        DeltaDecoder(bigger, header, held_version=7, held_digest=digest)
    with pytest.raises(DeltaError, match=r"starts with b'XXDELTA1', expected b'WSDELTA1'"):
        DeltaHeader.unpack(b"XX" + header.pack()[2:])
    with pytest.raises(DeltaError, match=r"delta header has 3 bytes, expected"):
        DeltaHeader.unpack(b"abc")


def _changed_pair(layout: Manifest, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    base = _snapshot(layout, tensors)
    new = base.clone()
    new.view(torch.int16)[::37] += 1
    return base, new


def test_corrupted_sparse_record_is_caught_by_a_record_check_or_the_checksum() -> None:
    layout, tensors = _layout(torch.bfloat16, bucket_bytes=1 << 20)
    base, new = _changed_pair(layout, tensors)
    enc = DeltaEncoder(layout)
    header = enc.header(version=2, base_version=1, base_sums=_sums(layout, base))
    (record,) = enc.encode(base, new)
    assert record.mode == SPARSE
    sent_sums = _sums(layout, new)
    caught = 0
    for pos in range(_RECORD_BYTES, len(record.payload), max(1, len(record.payload) // 40)):
        bad = bytearray(record.payload)
        bad[pos] ^= 0x10
        out = base.clone()
        dec = DeltaDecoder(layout, header, held_version=1, held_digest=header.base_digest)
        try:
            dec.decode_bucket(bytes(bad), out, out)
        except DeltaError:
            caught += 1
            continue
        assert _sums(layout, out) != sent_sums, f"flipped byte {pos} went unnoticed"
        caught += 1
    assert caught >= 10


def test_malformed_records_raise_naming_the_problem() -> None:
    layout, tensors = _layout(torch.bfloat16, bucket_bytes=1 << 20)
    base, new = _changed_pair(layout, tensors)
    enc = DeltaEncoder(layout)
    header = enc.header(version=2, base_version=1, base_sums=_sums(layout, base))
    (record,) = enc.encode(base, new)
    dec = DeltaDecoder(layout, header, held_version=1, held_digest=header.base_digest)
    out = base.clone()
    body = record.payload[_RECORD_BYTES:]
    with pytest.raises(DeltaError, match="shorter than its 21-byte header"):
        dec.decode_bucket(b"\x00" * 5, out, out)
    with pytest.raises(DeltaError, match="names bucket 3, the layout has 1"):
        dec.decode_bucket(struct.pack(_RECORD, 3, SPARSE, record.changed, 0) + body, out, out)
    with pytest.raises(DeltaError, match="unknown mode 9"):
        dec.decode_bucket(struct.pack(_RECORD, 0, 9, record.changed, 0) + body, out, out)
    with pytest.raises(DeltaError, match=r"claims \d+ changed words of \d+"):
        dec.decode_bucket(struct.pack(_RECORD, 0, SPARSE, 10**9, 0) + body, out, out)
    with pytest.raises(DeltaError, match=r"holds \d+ bytes, expected \d+|does not decompress"):
        dec.decode_bucket(struct.pack(_RECORD, 0, SPARSE, record.changed - 1, 0) + body, out, out)
    with pytest.raises(DeltaError, match="does not decompress"):
        dec.decode_bucket(record.payload[: len(record.payload) // 2], out, out)
    with pytest.raises(DeltaError, match=r"claims 99 long runs for 2 changes"):
        dec.decode_bucket(struct.pack(_RECORD, 0, SPARSE, 2, 99) + body, out, out)
    with pytest.raises(DeltaError, match=r"literal record for bucket 0 has 4 bytes, the bucket \d+"):
        dec.decode_bucket(struct.pack(_RECORD, 0, LITERAL, 1, 0) + b"abcd", out, out)
    with pytest.raises(DeltaError, match="unchanged record for bucket 0 carries 2 bytes"):
        dec.decode_bucket(struct.pack(_RECORD, 0, UNCHANGED, 0, 0) + b"ab", out, out)


def test_runs_pointing_past_the_bucket_are_refused() -> None:
    import zstandard

    layout, tensors = _layout(torch.bfloat16, bucket_bytes=1 << 20)
    base = _snapshot(layout, tensors)
    header = DeltaEncoder(layout).header(version=2, base_version=1, base_sums=_sums(layout, base))
    n_words = layout.total_bytes // 2
    # runs: escaped (n_words - 1), then 5: the second change lands past the end
    body = bytes([255, 5]) + bytes([1, 1, 0, 0]) + struct.pack("<I", n_words - 1)
    payload = struct.pack(_RECORD, 0, SPARSE, 2, 1) + zstandard.ZstdCompressor().compress(body)
    dec = DeltaDecoder(layout, header, held_version=1, held_digest=header.base_digest)
    out = base.clone()
    with pytest.raises(DeltaError, match=f"points past its {n_words} words"):
        dec.decode_bucket(payload, out, out)
    assert torch.equal(out, base)  # refused before any word was written


def test_versions_from_real_adamw_steps_round_trip() -> None:
    from lightning_wsync.testing.models import ModelSpec
    from lightning_wsync.testing.steps import Trainer

    trainer = Trainer(ModelSpec(d_model=16, vocab=64, n_layers=2), lr=1e-3, seed=0)
    tensors = select_tensors(trainer.model)
    layout = build_manifest(tensors, torch.bfloat16, 2048)
    versions = [_snapshot(layout, tensors)]
    for _ in range(3):
        trainer.step()
        versions.append(_snapshot(layout, tensors))
    held = versions[0].clone()
    for v in range(1, len(versions)):
        out, _ = _round_trip(layout, held, versions[v])
        assert torch.equal(out, versions[v])
        held = out
    assert not torch.equal(versions[0], versions[-1])
