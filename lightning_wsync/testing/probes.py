"""The library's own layout, snapshot copy and delta codec, for measurements.

``lightning-wsync bench`` is a client of the public API; where a figure must describe
the library's internals themselves (the bytes a push moves, the copy its snapshot makes,
its delta codec's size and speed) it reads them here, so it measures the code that runs
rather than a copy of it that could drift.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_wsync._control.manifest import build_manifest, checksum, copy_into, copy_tensors, select_tensors
from lightning_wsync._planes.delta.codec import DeltaDecoder, DeltaEncoder, DeltaHeader
from lightning_wsync.testing.models import ModelSpec
from lightning_wsync.testing.steps import GPT2_SPEC, Trainer

__all__ = ["DeltaSample", "measure_codec", "pushed_bytes", "snapshot_copy"]


def pushed_bytes(module: nn.Module, wire_dtype: torch.dtype | None, bucket_bytes: int) -> int:
    """Bytes one push of ``module`` moves: its tensors cast to ``wire_dtype``, laid out as a sender does."""
    return build_manifest(select_tensors(module), wire_dtype, bucket_bytes).total_bytes


def snapshot_copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i] <- src[i]``, casting, with the call a sender's snapshot makes."""
    copy_tensors(dst, src)


@dataclass(frozen=True)
class DeltaSample:
    """One version's delta against the previous version."""

    version: int
    loss: float
    changed_share: float  # words that differ / words in the buffer
    delta_bytes: int  # header + every bucket's record: what goes on the wire
    full_bytes: int
    encode_s: float
    decode_s: float
    verify_s: float  # the receiver's per-bucket checksums of the rebuilt version
    bit_exact: bool

    @property
    def wire_share(self) -> float:
        return self.delta_bytes / self.full_bytes


def measure_codec(
    *, spec: ModelSpec = GPT2_SPEC, lr: float, dtype: torch.dtype | None, pushes: int, bucket_bytes: int, seed: int
) -> tuple[list[DeltaSample], dict[str, object]]:
    """Train ``pushes`` steps; encode, decode and verify each version's delta; return samples and model facts."""
    trainer = Trainer(spec, lr=lr, seed=seed)
    tensors = select_tensors(trainer.model)
    layout = build_manifest(tensors, dtype, bucket_bytes)
    ring = [torch.zeros(layout.total_bytes, dtype=torch.uint8) for _ in range(2)]  # the sender's two buffers
    held = torch.zeros(layout.total_bytes, dtype=torch.uint8)  # the receiver's copy of the previous version
    copy_into(layout, ring[0], tensors.values())
    held.copy_(ring[0])
    base_sums = [checksum(ring[0], a, b) for a, b in layout.buckets]
    encoder = DeltaEncoder(layout)
    samples: list[DeltaSample] = []
    for version in range(1, pushes + 1):
        loss = trainer.step()
        base, new = ring[(version - 1) % 2], ring[version % 2]
        copy_into(layout, new, tensors.values())
        sums = [checksum(new, a, b) for a, b in layout.buckets]  # the sender hashes every version anyway
        start = time.perf_counter()
        header = encoder.header(version=version, base_version=version - 1, base_sums=base_sums)
        records = encoder.encode(base, new)
        encode_s = time.perf_counter() - start
        start = time.perf_counter()
        decoder = DeltaDecoder(layout, DeltaHeader.unpack(header.pack()), held_version=version - 1,
                               held_digest=header.base_digest)  # fmt: skip
        for record in records:
            decoder.decode_bucket(record.payload, held, held)
        decode_s = time.perf_counter() - start
        start = time.perf_counter()
        verified = [checksum(held, a, b) for a, b in layout.buckets] == sums
        verify_s = time.perf_counter() - start
        samples.append(
            DeltaSample(
                version=version, loss=loss,
                changed_share=sum(r.changed for r in records) / (layout.total_bytes // encoder.word_bytes),
                delta_bytes=DeltaHeader.SIZE + sum(len(r.payload) for r in records), full_bytes=layout.total_bytes,
                encode_s=encode_s, decode_s=decode_s, verify_s=verify_s,
                bit_exact=verified and torch.equal(held, new),
            )
        )  # fmt: skip
        base_sums = sums
    model: dict[str, object] = {"parameters": sum(t.numel() for t in tensors.values()), "tensors": len(tensors),
             "full_bytes": layout.total_bytes, "buckets": len(layout.buckets), "word_bytes": encoder.word_bytes,
             "d_model": spec.d_model, "vocab": spec.vocab, "layers": spec.n_layers}  # fmt: skip
    return samples, model
