"""The few messages a remote reader and the ring's owner exchange as NIXL notifications.

Reader to owner: ``P <tag> <after>`` (pin the newest version above ``after``; -1: any),
``T <tag>`` (progress: sent by the owner's NIXL on each completed chunk READ), ``U <tag>``
(unpin). Owner to reader: ``G <tag> <version> <slot> <seq> <trailer words>`` (granted,
with the version's signed trailer) or ``N <tag>`` (nothing newer to pin). ``tag`` numbers
a reader's pins, so a late answer to an earlier one is never taken for the current one.
"""

from __future__ import annotations

from typing import NamedTuple


class Grant(NamedTuple):
    tag: int
    version: int
    slot: int
    seq: int
    trailer: list[int]


def pin(tag: int, after: int | None) -> bytes:
    return f"P {tag} {-1 if after is None else after}".encode()


def touch(tag: int) -> bytes:
    return f"T {tag}".encode()


def unpin(tag: int) -> bytes:
    return f"U {tag}".encode()


def grant(g: Grant) -> bytes:
    return f"G {g.tag} {g.version} {g.slot} {g.seq} {','.join(map(str, g.trailer))}".encode()


def nothing(tag: int) -> bytes:
    return f"N {tag}".encode()


def parse(message: bytes) -> tuple[str, list[int]] | None:
    """(kind, numbers) of a message; None when it is not one of ours."""
    try:
        kind, *rest = message.decode("ascii").split(" ")
        numbers = [int(x) for part in rest for x in part.split(",") if x]
    except (UnicodeDecodeError, ValueError):
        return None
    if kind not in ("P", "T", "U", "G", "N") or not numbers:
        return None
    return kind, numbers


def as_grant(numbers: list[int]) -> Grant | None:
    if len(numbers) < 5:
        return None
    return Grant(numbers[0], numbers[1], numbers[2], numbers[3], numbers[4:])
