"""What both ends of a relay hop share: the chain record, chunking, hop headers, joining a hop.

A hop message is the wire's message (see :mod:`~lightning_wsync._planes.wire`): the full
version in :func:`chunks` (kind FULL; in a tree topology, one tree's half of them) or a
delta (kind DELTA), then the trainer's trailer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_wsync._control import keys
from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.records import ChainRecord
from lightning_wsync._control.store import Control
from lightning_wsync._planes.delta.wire import Held, parse_ready_note
from lightning_wsync._planes.wire import FULL, Header, PeerGroup, make_group

CHUNK_BYTES = 1 << 19  # pipelining unit between hops (a bucket is hashed once all its chunks are in)
TAIL_BYTES = 1 << 16  # the size the version's last chunk is halved down to
POLL_S = 0.002
CHAIN_POLL_S = 0.05
RELAY_RID = -1  # trailer MACs name no receiver: the same trailer is forwarded down the chain


def chunks(layout: Manifest) -> list[tuple[int, int, int]]:
    """``(start, end, bucket)`` pieces of at most CHUNK_BYTES, never straddling a bucket.

    The version's last chunk is split into pieces that halve down to TAIL_BYTES: the last
    byte reaches the H-th host one wire time after the first left the trainer plus H - 1
    times the last piece's wire time, so small last pieces save ~5 ms per hop at 700 Mbit/s.
    """
    out = []
    for i, (a, b) in enumerate(layout.buckets):
        for start in range(a, b, CHUNK_BYTES):
            out.append((start, min(b, start + CHUNK_BYTES), i))
    if out:
        start, end, bucket = out.pop()
        while end - start > TAIL_BYTES:
            half = start + (end - start) // 2
            out.append((start, half, bucket))
            start = half
        out.append((start, end, bucket))
    return out


@dataclass(frozen=True)
class Chain:
    number: int
    rids: tuple[int, ...]
    tree: bool = False  # two binary trees over rids (_planes.relay.plan), not a chain


def read_chain(ctl: Control, epoch: int) -> Chain | None:
    value = ctl.get_record(keys.relay_chain(epoch), ChainRecord)
    return None if value is None else Chain(value.number, value.rids, value.tree)


def hop_header(version: int, seq: int, layout: Manifest, kind: int, pieces: int | None = None) -> torch.Tensor:
    """``pieces``: how many of the version's chunks follow (a tree carries half of them)."""
    if kind != FULL:
        pieces = len(layout.buckets)
    elif pieces is None:
        pieces = len(chunks(layout))
    return Header(version, seq, layout.total_bytes, pieces, kind).tensor()


def wait_ready(ctl: Control, key: str, timeout_s: float, abandon: Callable[[], bool], peer: str) -> Held | None:
    """What the downstream side of a hop holds, from its ``ready`` note; raises TimeoutError past ``timeout_s``.

    Raises:
        Superseded: ``abandon()`` said to stop waiting.
    """
    deadline = time.monotonic() + timeout_s
    next_check = 0.0
    while not ctl.has(key):
        now = time.monotonic()
        if now >= next_check:
            if abandon():
                raise Superseded(key)
            next_check = now + CHAIN_POLL_S
        if now > deadline:
            raise TimeoutError(f"{peer} not ready for the next version within timeout_s={timeout_s}")
        time.sleep(POLL_S)
    held, _ = parse_ready_note(ctl.get_text(key))
    ctl.delete(key)
    return held


class Superseded(Exception):
    """The chain changed (or this side stopped) before the hop's peer showed up."""


JOINING, TAKEN, GONE = "1", "taken", "gone"  # a side's mark on a hop (keys.joined)


def join_hop(
    ctl: Control, prefix: str, rank: int, backend: str, addr: str, timeout_s: float, abandon: Callable[[], bool]
) -> PeerGroup:
    """Build a hop's group once its peer is known to be joining it too.

    Both sides first mark themselves under ``prefix`` (``JOINING``), and a side commits to
    the group only by taking the peer's mark (compare-and-set to ``TAKEN``), so a side whose
    peer has moved on to a newer chain leaves at the next check of ``abandon()`` instead of
    blocking in the group's set-up for timeout_s. A side leaves only by withdrawing its own
    mark (compare-and-set to ``GONE``); when the peer took it first, the peer is already
    building the group, which would block it for timeout_s alone, so this side builds it too
    and returns it (the caller sees ``abandon()`` at its next check and shuts it down).

    Raises:
        Superseded: ``abandon()`` said to leave before the peer committed.
        TimeoutError: no peer within ``timeout_s``.
    """
    mine, peer = keys.joined(prefix, rank), keys.joined(prefix, 1 - rank)
    ctl.set_text(mine, JOINING)
    deadline = time.monotonic() + timeout_s
    next_check = 0.0
    while True:
        if ctl.get_text(peer) == JOINING and ctl.compare_set(peer, JOINING, TAKEN) == TAKEN.encode():
            break
        now = time.monotonic()
        leave: Exception | None = None
        if now >= next_check:
            if abandon():
                leave = Superseded(prefix)
            next_check = now + CHAIN_POLL_S
        if leave is None and now > deadline:
            leave = TimeoutError(f"hop {prefix!r}: no peer within timeout_s={timeout_s}")
        if leave is not None:
            if ctl.compare_set(mine, JOINING, GONE) != TAKEN.encode():
                raise leave
            break  # the peer took this side's mark first: it is building the group
        time.sleep(POLL_S)
    return make_group(backend, ctl.prefix_store(prefix), rank, addr, timeout_s)


def error_text(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
