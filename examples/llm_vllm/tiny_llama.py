"""A tiny random Llama with a locally trained byte-level BPE tokenizer, written to a folder.

Nothing is downloaded: the tokenizer is trained with ``tokenizers`` on a generated corpus
and the weights are random. The folder loads with ``transformers`` and with vLLM alike.
"""

from __future__ import annotations

import random
import string
from pathlib import Path

import torch

VOCAB = 512
SPECIAL = ["<s>", "</s>", "<pad>"]


def corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """Words, numbers and short phrases: enough for 256 merges that cover digits and letters."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7))) for _ in range(300)]
    out = []
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(3, 10)):
            r = rng.random()
            if r < 0.5:
                parts.append(rng.choice(words))
            elif r < 0.8:
                parts.append(str(rng.randint(0, 99999)))
            else:
                parts.append(rng.choice(["say", "digits", "count", "number", "please", ":", "."]))
        out.append(" ".join(parts))
    return out


def write_tiny_llama(path: str | Path, *, seed: int = 0, init_std: float = 0.02, **sizes: int) -> Path:
    """Write config, random weights (safetensors) and tokenizer of a 2-layer Llama to ``path``.

    ``sizes`` override the config (e.g. ``hidden_size``, ``num_hidden_layers``, ``vocab_size``
    above the tokenizer's 512 for a bigger model of the same shape).
    """
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus(seed=seed), vocab_size=VOCAB, min_frequency=2, special_tokens=SPECIAL)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.save_pretrained(path)
    shape = {
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,  # head_dim 32: vLLM's CPU attention needs >= 32
        "num_key_value_heads": 2,
        **sizes,
    }
    config = LlamaConfig(
        **shape,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        initializer_range=init_std,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return path
