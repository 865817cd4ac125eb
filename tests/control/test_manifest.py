"""Fast unit tests of the flat layout's copies and of the shared segment's header."""

from __future__ import annotations

import torch

from lightning_wsync._control.manifest import build_manifest, copy_out, copy_tensors, entry_views


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(7, 5, generator=g),
        "t": torch.randn(5, 7, generator=g).t(),  # non-contiguous
        "h": torch.randn(3, generator=g).to(torch.bfloat16),
        "n": torch.arange(4, dtype=torch.int64),
    }


def test_fused_copies_cast_and_round_trip_every_dtype_and_stride():
    src = _tensors()
    layout = build_manifest(src, torch.bfloat16, 1 << 20)
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    copy_tensors(entry_views(layout, buffer), list(src.values()))
    dst = {k: torch.zeros_like(v) for k, v in src.items()}  # "t" stays non-contiguous
    dst["t"] = torch.zeros(5, 7).t()
    copy_out(layout, buffer, dst.values())
    for k, v in src.items():
        want = v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v
        assert torch.equal(dst[k], want), k
    copy_tensors([], [])  # nothing selected: nothing to do
