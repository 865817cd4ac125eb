"""The demo's verifiable task: answer a prompt with digits only.

The reward of a completion is the fraction of its tokens that are digits (a leading
space allowed), checked from the token text alone. A random model scores about 0.2.
"""

from __future__ import annotations

PROMPTS = [
    "say digits:",
    "count please:",
    "number . say",
    "digits please :",
    "abc say count:",
    "please say a number:",
    "count .",
    "say it:",
]
GROUP = 8  # completions sampled per prompt: the reward baseline is the group's mean
NEW_TOKENS = 12


def digit_tokens(tokenizer) -> set[int]:  # type: ignore[no-untyped-def]
    """Ids of tokens whose text is digits, optionally after one leading space."""
    ids = set()
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        core = text.removeprefix(" ")
        if core and core.isascii() and core.isdigit():
            ids.add(i)
    return ids


def reward(completion: list[int], digits: set[int]) -> float:
    return sum(t in digits for t in completion) / max(1, len(completion))
