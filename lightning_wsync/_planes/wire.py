"""A standalone two-rank process group, as every network hop uses one, and the one message
format every hop (a direct link, a relay hop) sends a version in:

    header  int64 [version, slot sequence, bytes, pieces, kind]     (:class:`Header`)
    body    ``pieces`` pieces of the version (FULL), or a delta (DELTA: one record per bucket)
    trailer int64 [slot sequence after the send (-1: overwritten), checksum per bucket, HMAC]

:func:`verify` is the one check of a received version, on every hop.

Groups are ``ProcessGroupGloo``/``ProcessGroupNCCL`` objects on a prefix of the shared
store, never the default group (that one belongs to Lightning's DDP): a peer that dies or
stalls fails only its own group.
"""

from __future__ import annotations

import hmac
import logging
import struct
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import NamedTuple, Protocol, cast

import torch
import torch.distributed as dist

from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.store import Control

log = logging.getLogger(__name__)


class Work(Protocol):
    def wait(self) -> bool: ...


class TimedWork(Protocol):
    def wait(self, timeout: timedelta) -> bool: ...


class PeerGroup(Protocol):
    """What this module uses of a standalone gloo/NCCL backend object."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> Work: ...
    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> Work: ...
    def abort(self) -> None: ...


def make_group(backend: str, store: dist.Store, rank: int, addr: str, timeout_s: float) -> PeerGroup:
    """A standalone two-rank group; blocks (GIL released) until the peer joins or timeout."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # missing from stubs
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=addr)]
        return cast(PeerGroup, dist.ProcessGroupGloo(store, rank, 2, opts))
    if backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return cast(PeerGroup, dist.ProcessGroupNCCL(store, rank, 2, nccl_opts))
    raise ValueError(f"unknown network backend {backend!r}; expected 'gloo' or 'nccl'")


class Interruptible:
    """A peer group whose blocked waits another thread can end, most of them.

    gloo's ``abort()`` wakes no waiter; a wait that times out closes the pair (gloo's tcp
    ``Pair::signalException``), and that wakes the waits it knows of. :meth:`interrupt`
    does so, so a link stops on close instead of at ``timeout_s`` (one stalled peer each,
    in turn, would take N x timeout_s). What it ends and what it cannot: see :meth:`interrupt`.
    """

    def __init__(self, pg: PeerGroup, backend: str) -> None:
        self._pg = pg
        self._gloo = backend == "gloo"  # NCCL's timed wait is not known to end only this pair: left alone
        self._waiting: set[Work] = set()
        self._lock = threading.Lock()
        self._interrupted = False

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> Work:
        return _Tracked(self, self._pg.send(tensors, dst_rank, tag))

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> Work:
        return _Tracked(self, self._pg.recv(tensors, src_rank, tag))

    def abort(self) -> None:
        self._pg.abort()

    def interrupt(self) -> None:
        """End the waits blocked on this group now, where gloo lets it; later waits raise at once.

        Ended: a receive whose bytes have not begun to arrive, and a send the peer has
        not yet asked for (its receive not posted): gloo's pair wakes the buffers it holds
        as pending when it closes. Not ended: a send or a receive already handed to the
        socket (the peer's receive was posted: the send sits in the pair's transmit queue,
        written in part or not at all; or a receive partly read). gloo's pair closing wakes
        only bound buffers in that queue, not these (gloo ``tcp/pair.cc``,
        ``Pair::signalException``), so their waiter wakes at the group timeout
        (``timeout_s``), measured: the tree head leaves such a send behind
        (``relay/hops.py``, ``send_apart``). No byte moves after the close either way.
        """
        with self._lock:
            self._interrupted = True
            waiting = list(self._waiting) if self._gloo else []
        for work in waiting:
            try:
                cast(TimedWork, work).wait(timedelta(milliseconds=1))
            except (RuntimeError, TypeError):  # the expected timeout; TypeError: a wrapper without timeout=
                pass

    def close(self, peer: int) -> None:
        """:meth:`interrupt`, then :func:`close_group`: the peer's waits end too."""
        self.interrupt()
        close_group(self._pg, peer, "gloo" if self._gloo else "nccl")

    def _wait(self, work: Work) -> bool:
        with self._lock:
            if self._interrupted:
                raise RuntimeError("link closed")
            self._waiting.add(work)
        try:
            return work.wait()
        finally:
            with self._lock:
                self._waiting.discard(work)


class _Tracked:
    def __init__(self, owner: Interruptible, work: Work) -> None:
        self._owner = owner
        self._work = work

    def wait(self) -> bool:
        return self._owner._wait(self._work)


def shutdown_group(pg: PeerGroup | None) -> None:
    if pg is None:
        return
    try:
        pg.abort()
    except RuntimeError:
        pass


_CLOSE_TAG = 0x7C105E  # a tag no message uses: a receive on it can only time out


def close_group(pg: PeerGroup | None, peer: int, backend: str) -> None:
    """Abort a two-rank group and, with gloo, close its connection to ``peer`` now.

    An aborted gloo group keeps its connection open while any of its works is still
    referenced (a send posted and never waited), so a peer blocked in a receive from this
    side would wait for its group timeout. A receive that times out closes the pair, and
    the peer's pending waits end at once ("Connection closed by peer"), but a send it has begun
    to write ends at its own group timeout (``tests/relay/gloo_peer_close.py``: 15 of 15).
    """
    if pg is None:
        return
    if isinstance(pg, Interruptible):
        pg.close(peer)
        return
    if backend == "gloo":
        probe = torch.zeros(1, dtype=torch.uint8)
        try:
            cast(TimedWork, pg.recv([probe], peer, _CLOSE_TAG)).wait(timedelta(milliseconds=1))
        except RuntimeError:  # the expected timeout (or a pair closed already)
            pass
    shutdown_group(pg)


def to_int64(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


MAC_WORDS = 4  # 32 bytes of HMAC-SHA256 as int64 words
FULL, DELTA = 0, 1  # a message's kind: the version's bytes, or a delta against a version the peer holds
HEADER_WORDS = 5
OVERWRITTEN = -1  # a trailer's first word when the version is not what its header announced


class Header(NamedTuple):
    """What precedes every version on every hop."""

    version: int
    seq: int  # the sender's slot sequence when the send began
    total_bytes: int
    pieces: int  # FULL: how many pieces the bytes come in; DELTA: how many bucket records
    kind: int  # FULL or DELTA

    def tensor(self) -> torch.Tensor:
        return torch.tensor(list(self), dtype=torch.int64)

    @classmethod
    def unpack(cls, words: torch.Tensor) -> Header:
        version, seq, total_bytes, pieces, kind = (int(x) for x in words.cpu())
        return cls(version, seq, total_bytes, pieces, kind)

    def check(self, total_bytes: int, full_pieces: int, buckets: int) -> None:
        """Raise when this header does not fit the layout the receiving side expects (the hop is out of step)."""
        want = full_pieces if self.kind == FULL else buckets
        if self.kind not in (FULL, DELTA) or self.total_bytes != total_bytes or self.pieces != want:
            raise RuntimeError(
                f"version {self.version}: layout mismatch ({self.total_bytes} bytes, {self.pieces} pieces, kind "
                f"{self.kind}; expected {total_bytes} bytes, {full_pieces} pieces in full or {buckets} records)"
            )


def pieces(buckets: Sequence[tuple[int, int]], piece_bytes: int) -> list[tuple[int, int, int]]:
    """``(start, end, bucket)``: every bucket cut into pieces of at most ``piece_bytes``.

    A sender's lease on its slot is renewed after each piece goes out, so a slow link
    that still makes progress keeps its slot (one renewal per 32 MiB bucket superseded
    every link slower than ~55 Mbit/s at a 5 s lease).
    """
    return [(a, min(end, a + piece_bytes), i) for i, (start, end) in enumerate(buckets)
            for a in range(start, end, piece_bytes)]  # fmt: skip


def trailer_words(buckets: int) -> int:
    return 1 + buckets + MAC_WORDS


def signed_trailer(
    ctl: Control, epoch: int, rid: int, version: int, seq: int, sums: list[int] | None, *, intact: bool, buckets: int
) -> torch.Tensor:
    """The trailer of a version sent from slot sequence ``seq``: ``intact`` False (or no
    checksums) marks it overwritten during the send, and the receiver drops it."""
    words = [to_int64(s) for s in (sums or [0] * buckets)]
    mac = trailer_mac(ctl, epoch, rid, version, seq, words)
    return torch.tensor([seq if intact and sums is not None else OVERWRITTEN] + words + mac, dtype=torch.int64)


def trailer_mac(ctl: Control, epoch: int, rid: int, version: int, seq: int, sums: list[int]) -> list[int]:
    """Signs what the receiver checks the bytes against (zeros when the job has no secret)."""
    message = f"{epoch}/{rid}/{version}/{seq}/".encode() + struct.pack(f"<{len(sums)}q", *sums)
    return list(struct.unpack(f"<{MAC_WORDS}q", ctl.mac_bytes(message)))


def trailer_signed(ctl: Control, epoch: int, rid: int, version: int, seq: int, sums: list[int], mac: list[int]) -> bool:
    """Whether ``mac`` is :func:`trailer_mac` of the rest of a received trailer (compared in constant time)."""
    expected = trailer_mac(ctl, epoch, rid, version, seq, sums)
    return hmac.compare_digest(struct.pack(f"<{MAC_WORDS}q", *mac), struct.pack(f"<{MAC_WORDS}q", *expected))


def sums_mismatch(buckets: Sequence[tuple[int, int]], got: list[int], sent: list[int], where: str = "") -> str | None:
    """What differs between the checksums computed here and those the trailer carries (None: all match)."""
    bad = [i for i, (x, y) in enumerate(zip(got, sent)) if x != y]
    if not bad:
        return None
    a, b = buckets[bad[0]]
    return f"checksum mismatch{where} in {len(bad)} bucket(s), first bytes [{a}, {b})"


class Verdict(NamedTuple):
    """What became of one received version."""

    accepted: bool
    reason: str | None  # why it was rejected; None when accepted or dropped (overwritten during its send)
    sums: list[int] | None  # accepted with checksums: the trailer's (unsigned), naming what the buffer holds


class Arrival(NamedTuple):
    """One version as it came in, for :func:`verify`."""

    version: int
    seq: int  # the slot sequence its header announced
    trailer: list[int]
    sums: list[int] | None  # checksums computed here; None: none can be (a CUDA buffer)
    delta_error: str | None  # why a delta could not be rebuilt


def verify(ctl: Control, layout: Manifest, *, epoch: int, rid: int, got: Arrival, where: str = "") -> Verdict:
    """The one check of a version received on any hop (a direct link, a relay hop), in this order.

    The trailer's slot sequence must equal the header's (else the sender's slot was
    overwritten during the send, or an upstream leader could not rebuild it: dropped
    without a rejection, the next version follows); its MAC must verify for (``epoch``,
    ``rid``) with the job's secret; a delta must have been rebuilt; every checksum
    computed here must equal the trailer's. ``where`` goes into the messages.
    """
    nb = len(layout.buckets)
    if len(got.trailer) != trailer_words(nb):
        raise RuntimeError(f"version {got.version}: a trailer of {len(got.trailer)} words; the hop is out of step")
    if got.trailer[0] != got.seq:
        log.debug("version %d%s was overwritten during its send, or not rebuilt upstream; waiting for the next",
                  got.version, where)  # fmt: skip
        return Verdict(False, None, None)
    sent, mac = got.trailer[1 : 1 + nb], got.trailer[1 + nb :]
    if not trailer_signed(ctl, epoch, rid, got.version, got.seq, sent, mac):
        return Verdict(False, f"trailer not signed with this job's secret{where} (secret= / WSYNC_SECRET)", None)
    if got.delta_error is not None:
        return Verdict(False, f"delta not applied{where} ({got.delta_error}); the next version comes in full", None)
    if got.sums is None:
        return Verdict(True, None, None)
    mismatch = sums_mismatch(layout.buckets, got.sums, sent, where=where)
    if mismatch is not None:
        return Verdict(False, mismatch, None)
    return Verdict(True, None, [s & (2**64 - 1) for s in sent])
