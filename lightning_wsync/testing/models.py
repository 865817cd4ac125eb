"""The benchmark's payload: a transformer-shaped module sized to a number of MiB.

The shape follows the reference measurements in ``shared/perf.md``: a token
embedding, 12 blocks of (layer norm, q/k/v/out projections with biases, layer norm,
two MLP matrices with biases) and a final layer norm: 195 float32 tensors, from
a few KiB (biases) to ~12% of the total (the embedding).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import xxhash
from torch import nn

N_LAYERS = 12
_DIGEST_CHUNK_ELEMS = 1 << 22  # cast for the digest in chunks: no model-sized temporaries


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions of the benchmark model; picklable, so receivers build the same one."""

    d_model: int
    vocab: int
    n_layers: int = N_LAYERS

    @property
    def numel(self) -> int:
        d = self.d_model
        per_block = 12 * d * d + 13 * d
        return self.n_layers * per_block + self.vocab * d + 2 * d

    @property
    def nbytes(self) -> int:
        return 4 * self.numel

    @property
    def n_tensors(self) -> int:
        return 1 + 16 * self.n_layers + 2


def spec_for_size(size_mb: float) -> ModelSpec:
    """The model whose float32 weights come closest to ``size_mb`` MiB from below.

    About 88% of the bytes sit in the 12 blocks, the rest in the embedding, as in a
    GPT-2-like model.

    Raises:
        ValueError: ``size_mb`` is below 1.
    """
    if not size_mb >= 1:
        raise ValueError(f"bench: --size-mb={size_mb!r} must be >= 1 (MiB of float32 weights), e.g. --size-mb 256")
    floats = int(size_mb * 2**20) // 4
    raw = math.sqrt(0.88 * floats / (12 * N_LAYERS))
    step = 64 if raw >= 512 else 8  # fine steps keep small models transformer-shaped
    d = max(8, int(raw) // step * step)
    block_floats = N_LAYERS * (12 * d * d + 13 * d) + 2 * d
    vocab = max(1, (floats - block_floats) // d)
    return ModelSpec(d_model=d, vocab=vocab)


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)


class BenchModel(nn.Module):
    """Weights only (no forward): what a push moves is all that matters here."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.d_model)
        self.blocks = nn.ModuleList(_Block(spec.d_model) for _ in range(spec.n_layers))
        self.ln_f = nn.LayerNorm(spec.d_model)


def build_model(spec: ModelSpec, *, seed: int | None) -> BenchModel:
    """Allocate the model with every page touched: random weights for ``seed``, zeros for None."""
    with torch.device("meta"):
        model = BenchModel(spec)
    model = model.to_empty(device="cpu")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if generator is None:
                t.zero_()
            else:
                t.uniform_(-0.05, 0.05, generator=generator)
    return model


def mutate(model: nn.Module, version: int) -> None:
    """Change every tensor in place, deterministically, so each version has distinct bytes
    (a step of 0.01 still moves bfloat16 values near 1)."""
    with torch.no_grad():
        for t in model.state_dict().values():
            t.add_(0.01 * version if t.is_floating_point() else version)


def touch(model: nn.Module, version: int, share: float = 0.02) -> None:
    """Change the first ``share`` of every floating tensor's elements (a sparse step: what a delta
    push sends little of), deterministically."""
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                flat = t.view(-1)
                flat[: max(1, int(flat.numel() * share))].add_(0.01 * version)


def _chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    flat = t.detach().reshape(-1)
    for start in range(0, flat.numel(), _DIGEST_CHUNK_ELEMS):
        yield flat[start : start + _DIGEST_CHUNK_ELEMS]


def digest(model: nn.Module, wire_dtype: torch.dtype | None = None) -> str:
    """xxh3-128 of every tensor's name and bytes (on any device), as cast to ``wire_dtype`` when given.

    A receiver's float32 module that got a bfloat16 push holds bfloat16 values
    exactly, so casting both sides to the wire dtype compares them bit for bit.
    """
    h = xxhash.xxh3_128()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        for chunk in _chunks(t):
            if wire_dtype is not None and chunk.is_floating_point() and chunk.dtype != wire_dtype:
                chunk = chunk.to(wire_dtype)
            h.update(chunk.cpu().contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()
