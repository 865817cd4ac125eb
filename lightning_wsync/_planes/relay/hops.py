"""What both ends of a relay hop share: the chain record, chunking, hop headers, joining a hop,
waiting on the store (:func:`poll`) and the head's sends left behind on a topology change.

A hop message is the wire's message (see :mod:`~lightning_wsync._planes.wire`): the full
version in :func:`chunks` (kind FULL; in a tree topology, one tree's half of them) or a
delta (kind DELTA), then the trainer's trailer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_wsync._control import keys
from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.records import ChainRecord
from lightning_wsync._control.store import Control
from lightning_wsync._planes.delta.wire import Held, parse_ready_note
from lightning_wsync._planes.relay import exits
from lightning_wsync._planes.shm.ring import Lease, SnapshotRing
from lightning_wsync._planes.wire import FULL, Header, PeerGroup, make_group

CHUNK_BYTES = 1 << 20  # the smallest pipelining unit between hops (:func:`chunk_bytes`)
MAX_CHUNK_BYTES = 1 << 22  # the largest
CHUNKS_PER_VERSION = 128  # a version is cut into about this many chunks between those two sizes
CHUNK_ALIGN = 1 << 16  # chunk sizes are multiples of this (whole words of any dtype)
TAIL_BYTES = 1 << 16  # the size the version's last chunk is halved down to
POLL_S = 0.002
CHAIN_POLL_S = 0.05
RELAY_RID = -1  # trailer MACs name no receiver: the same trailer is forwarded down the chain

log = logging.getLogger(__name__)


def chunk_bytes(total_bytes: int) -> int:
    """The pipelining unit for a version of ``total_bytes``: about 1/CHUNKS_PER_VERSION of it,
    within CHUNK_BYTES..MAX_CHUNK_BYTES.

    Each hop holds the version back by about one chunk's wire time, so a chunk of 1/128 of the
    version costs under 1% of the version's wire time per hop, whatever the link. Every chunk
    also costs each hop a fixed amount of CPU (a gloo message each way, a wait, a post, a
    hash update: tens of microseconds of Python and of gloo's loop threads). With 512 KiB
    chunks that fixed part was a fifth of a hop's CPU at 64 MiB and more for versions of
    hundreds of MiB (docs/benchmarks.md), so no chunk is smaller than 1 MiB: versions up to
    128 MiB get 1 MiB chunks (about 1.2 ms of wire per hop at 10 Gbit/s, 12 ms at 700 Mbit/s),
    256 MiB ones 2 MiB.
    """
    size = total_bytes // CHUNKS_PER_VERSION // CHUNK_ALIGN * CHUNK_ALIGN
    return max(CHUNK_BYTES, min(MAX_CHUNK_BYTES, size))


def chunks(layout: Manifest) -> list[tuple[int, int, int]]:
    """``(start, end, bucket)`` pieces of at most :func:`chunk_bytes`, never straddling a bucket.

    The version's last chunk is split into pieces that halve down to TAIL_BYTES: the last
    byte reaches the H-th host one wire time after the first left the trainer plus H - 1
    times the last piece's wire time, so small last pieces save ~5 ms per hop at 700 Mbit/s.
    Every cut is on a multiple of 8 bytes from the bucket's start (the delta codec's groups).
    """
    out = []
    size = chunk_bytes(layout.total_bytes)
    for i, (a, b) in enumerate(layout.buckets):
        for start in range(a, b, size):
            out.append((start, min(b, start + size), i))
    if out:
        start, end, bucket = out.pop()
        while end - start > TAIL_BYTES:
            half = start + (end - start) // 16 * 8  # whole words: a tree's delta records are cut here
            out.append((start, half, bucket))
            start = half
        out.append((start, end, bucket))
    return out


@dataclass(frozen=True, kw_only=True)
class Stream:
    """One relay stream: what every hop of it (the head's, each leader's downstream) is made with.

    ``number`` is the sender's epoch, or for a sharded push one trainer rank's stream
    (:func:`~lightning_wsync._control.keys.relay_stream`): the stream names its elections,
    chain, hops and trailer MACs on the store.
    """

    number: int
    backend: str  # the hops' process groups: gloo | nccl
    addr: str  # where the hops meet (the sender's address)
    timeout_s: float  # the sender's: it bounds every hop, whatever a receiver's
    nixl: bool = False  # transport='nixl': each leader READs from upstream itself (nixl/hop.py); a chain only


@dataclass(frozen=True)
class Chain:
    number: int
    rids: tuple[int, ...]
    tree: bool = False  # two binary trees over rids (_planes.relay.plan), not a chain


def read_chain(ctl: Control, epoch: int) -> Chain | None:
    value = ctl.get_record(keys.relay_chain(epoch), ChainRecord)
    return None if value is None else Chain(value.number, value.rids, value.tree)


def mark_broken(ctl: Control, epoch: int, rid: int) -> None:
    """Say that the hop into leader ``rid`` failed (the sender drops it from the chain)."""
    ctl.set_text(keys.relay_broken(epoch, rid), "1")
    ctl.bump(keys.relay_moved(epoch))  # the sender reads the broken keys when this moves


def ring_bell(ctl: Control, epoch: int, rid: int) -> None:
    """Ring leader ``rid``'s bell: it reads the chain and its leader record again (:mod:`.bell`)."""
    ctl.set_text(keys.relay_bell(epoch, rid), "1")


def hop_header(version: int, seq: int, layout: Manifest, kind: int, pieces: int | None = None) -> torch.Tensor:
    """``pieces``: how many of the version's chunks, or records of a delta, follow (a tree carries
    one per chunk of its half, either way; a chain's delta one per bucket)."""
    if pieces is None:
        pieces = len(chunks(layout)) if kind == FULL else len(layout.buckets)
    return Header(version, seq, layout.total_bytes, pieces, kind).tensor()


def wait_ready(
    ctl: Control,
    key: str,
    ring: SnapshotRing,
    sent: int | None,
    timeout_s: float,
    superseded: Callable[[], bool],
    peer: str,
) -> Held | None:
    """What the downstream side of a hop holds, from its ``ready`` note: waited for without a
    bound while ``ring`` has nothing newer than ``sent``, for ``timeout_s`` once it has (a peer
    stalled that long fails its hop).

    Raises:
        Superseded: ``superseded()`` said to stop waiting.
        TimeoutError: ``peer`` not ready for a newer version within ``timeout_s``.
    """  # fmt: skip
    pending_since: float | None = None

    def abandon() -> bool:
        nonlocal pending_since
        newest = ring.newest()
        if newest is not None and (sent is None or newest.version > sent):
            now = time.monotonic()
            pending_since = now if pending_since is None else pending_since
            if now - pending_since > timeout_s:
                raise TimeoutError(f"{peer} not ready for version {newest.version} within timeout_s={timeout_s}")
        return superseded()

    leave = poll(lambda: ctl.has(key), abandon, key)
    if leave is not None:
        raise leave
    held, _ = parse_ready_note(ctl.get_text(key))
    ctl.delete(key)
    return held


def poll(
    done: Callable[[], bool], abandon: Callable[[], bool], what: str, timeout_s: float = float("inf")
) -> Exception | None:
    """Check ``done()`` every POLL_S until it is true (None), else why to stop waiting for ``what``:
    :class:`Superseded` when ``abandon()`` (asked every CHAIN_POLL_S) says so, TimeoutError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    next_check = 0.0
    while not done():
        now = time.monotonic()
        if now >= next_check:
            if abandon():
                return Superseded(what)
            next_check = now + CHAIN_POLL_S
        if now > deadline:
            return TimeoutError(f"{what} within timeout_s={timeout_s}")
        time.sleep(POLL_S)
    return None


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

    def committed() -> bool:
        return ctl.get_text(peer) == JOINING and ctl.compare_set(peer, JOINING, TAKEN) == TAKEN.encode()

    leave = poll(committed, abandon, f"hop {prefix!r}: no peer", timeout_s)
    # A side leaves only by withdrawing its mark; when the peer took it first, it is building the group.
    if leave is not None and ctl.compare_set(mine, JOINING, GONE) != TAKEN.encode():
        raise leave
    return make_group(backend, ctl.prefix_store(prefix), rank, addr, timeout_s)


def next_lease(ring: SnapshotRing, sent: int | None, superseded: Callable[[], bool]) -> Lease | None:
    """A lease on the newest version above ``sent`` (its slot is not rewritten while the send
    holds it), or None once ``superseded()``: the peer may have left the topology already."""
    lease = None
    while lease is None and not superseded():
        lease = ring.acquire_newer(sent, 0.05)
    if lease is not None and superseded():
        lease.release()
        return None
    return lease


def send_apart(
    send: Callable[[], None], release: Callable[[], None], superseded: Callable[[], bool], name: str,
    timeout_s: float,
) -> None:  # fmt: skip
    """Run ``send`` in a thread of its own (named ``name``) and wait for it; leave it behind when
    ``superseded()`` first. ``release`` (the send's slots) runs when the send ends, wherever.

    The head's side of a hop: a gloo send partly written to a peer that stopped reading (it
    left for a newer chain or trees mid-version) is woken by nothing, not an interrupt, not
    the pair's closing, until the group timeout (``timeout_s``); the head feeds the new topology
    meanwhile, and the send left behind ends on its own within ``timeout_s`` (its group is closed).
    Until it ends, the process's exit waits for it (:mod:`~lightning_wsync._planes.relay.exits`).

    Raises:
        Superseded: the topology changed before the send ended.
    """  # fmt: skip
    done = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            send()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, unless the caller left already
            failed.append(exc)
        finally:
            release()
            done.set()

    try:
        exits.start(run, name, timeout_s)
    except BaseException:
        release()
        raise
    while not done.wait(CHAIN_POLL_S):
        if superseded():
            log.debug("relay: the topology changed during %s; its send is left to end on its own", name)
            raise Superseded(name)
    if failed:
        raise failed[0]


def error_text(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
