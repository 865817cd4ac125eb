"""The few messages a remote reader and the ring's owner exchange as NIXL notifications.

Reader to owner: ``P <tag> <after>`` (pin the newest version above ``after``; -1: any),
``T <tag>`` (progress: sent by the owner's NIXL on each completed chunk READ), ``U <tag>``
(unpin). Owner to reader: ``G <tag> <version> <slot> <seq> <trailer words>`` (granted,
with the version's signed trailer) or ``N <tag>`` (nothing newer to pin). ``tag`` numbers
a reader's pins, so a late answer to an earlier one is never taken for the current one.
"""

from __future__ import annotations

from typing import NamedTuple

RELAY_RID = -1  # relay.hops.RELAY_RID (a layer above): trailers of relay hops name no receiver

_KINDS = ("P", "T", "U", "G", "N", "H", "L", "K", "D")  # H, L, K, D: relay hops (hop.py)


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
    if kind not in _KINDS or not numbers:
        return None
    return kind, numbers


def as_grant(numbers: list[int]) -> Grant | None:
    if len(numbers) < 5:
        return None
    return Grant(numbers[0], numbers[1], numbers[2], numbers[3], numbers[4:])


# -- relay hops (hop.py): the upstream leader lends the version it is still writing ----------


class HopGrant(NamedTuple):
    """A pin granted on a relay leader's ring: ``draft`` 1 while the version is still being
    written there (``landed`` bytes of it so far; its end is told by :func:`kept` or
    :func:`dropped`), 0 once published. ``origin_seq``: the trainer's slot sequence, which the
    forwarded ``trailer`` is signed with; ``seq``: the slot's here (odd while a draft)."""

    tag: int
    version: int
    slot: int
    seq: int
    origin_seq: int
    draft: int
    landed: int
    trailer: list[int]


def hop_grant(g: HopGrant) -> bytes:
    head = f"H {g.tag} {g.version} {g.slot} {g.seq} {g.origin_seq} {g.draft} {g.landed}"
    return f"{head} {','.join(map(str, g.trailer))}".encode()


def as_hop_grant(numbers: list[int]) -> HopGrant | None:
    if len(numbers) < 8:
        return None
    n = numbers
    return HopGrant(n[0], n[1], n[2], n[3], n[4], n[5], n[6], n[7:])


def landed(tag: int, nbytes: int) -> bytes:
    return f"L {tag} {nbytes}".encode()


def kept(tag: int) -> bytes:
    """The draft was verified and published: its slot's sequence is now ``seq + 1``."""
    return f"K {tag}".encode()


def dropped(tag: int) -> bytes:
    """The draft was given up (it failed upstream): the reader drops the version, no rejection."""
    return f"D {tag}".encode()
