"""Versions made by real optimizer steps on the benchmark's transformer-shaped model.

How much a 16-bit version differs from the previous one depends on the optimizer, the
learning rate and the magnitude of each weight (a bf16 value changes only when its
float32 master crosses a rounding boundary), so the delta benchmark trains: GPT-2's
initialisation (normal(0, 0.02), residual projections scaled by 1/sqrt(2 * layers),
zero biases, unit layer norms), a causal language-model loss on random tokens, AdamW.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F

from lightning_wsync.testing.models import BenchModel, ModelSpec, _Block, build_model

GPT2_SPEC = ModelSpec(d_model=768, vocab=50257)  # 124M parameters, as Hugging Face's "gpt2" (no position table)
_HEAD_DIM = 64


def gpt2_init_(model: BenchModel, *, seed: int) -> None:
    """GPT-2's initialisation, in place."""
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * len(model.blocks))
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("bias"):
                t.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                t.fill_(1.0)
            elif name.endswith(("out.weight", "fc2.weight")):
                t.normal_(0.0, residual_std, generator=generator)
            else:
                t.normal_(0.0, 0.02, generator=generator)


def lm_loss(model: BenchModel, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a causal transformer over ``tokens`` (batch, time)."""
    d = model.tok.embedding_dim
    heads = max(1, d // _HEAD_DIM)
    batch, time = tokens.shape
    x = model.tok(tokens)
    for module in model.blocks:
        block = cast(_Block, module)
        h = block.ln1(x)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, time, heads, d // heads).transpose(1, 2)

        att = F.scaled_dot_product_attention(split(block.q(h)), split(block.k(h)), split(block.v(h)), is_causal=True)
        x = x + block.out(att.transpose(1, 2).reshape(batch, time, d))
        x = x + block.fc2(F.gelu(block.fc1(block.ln2(x))))
    logits = model.ln_f(x) @ model.tok.weight.t()  # tied head, as GPT-2
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class Trainer:
    """A model and its AdamW optimizer; :meth:`step` makes the next version of its weights."""

    def __init__(self, spec: ModelSpec, *, lr: float, seed: int, tokens_per_step: int = 64) -> None:
        self.model = build_model(spec, seed=None)
        gpt2_init_(self.model, seed=seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        self._generator = torch.Generator().manual_seed(seed + 1)
        self._vocab = spec.vocab
        self._time = max(2, tokens_per_step // 2)
        self.steps = 0

    def step(self) -> float:
        """One optimizer step on a fresh batch of random tokens; returns the loss."""
        tokens = torch.randint(0, self._vocab, (2, self._time), generator=self._generator)
        self.optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(self.model, tokens)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        self.steps += 1
        return float(loss.detach())
