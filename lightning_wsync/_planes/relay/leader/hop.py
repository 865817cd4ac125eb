"""A host leader's receiving side: receive each version from upstream, rebuild and verify it, forward it.

One receive path (:class:`HopReceiver`) takes the shape upstream as the reader of its body:
a chain's one hop (:class:`ChainHop`, here) or a tree's two halves
(:class:`~lightning_wsync._planes.relay.leader.treehop.TreeHop`). Each version is written
straight into a free slot of the host's ring (a draft, published with no copy once verified;
a private staging buffer when every slot is held). The buffer holding the last version
accepted is the base of the next delta, which is rebuilt from it into the new slot (in place
when the base's slot is the only free one). The hop downstream is
:class:`~lightning_wsync._planes.relay.down.Downstream`. What goes downstream is decided per
message from the next leader's ``ready`` note:

- a full version arrives: forwarded chunk by chunk as it arrives;
- a delta arrives and the next leader holds its base: the records are forwarded as they
  arrive, before this leader decodes them, so a delta crosses the chain about as fast
  as one record per hop;
- a delta arrives and the next leader holds anything else: each bucket is forwarded as
  soon as it is rebuilt here, as a full version. When this leader cannot rebuild it,
  the trailer it forwards says so (first word -1) and the next leader drops the version
  without a rejection; the trailer's signed words are forwarded as they came.

Longer than 300 lines: the one receive path both shapes read through, beside the chain's
shape, whose delta rebuild is the receive path's other half.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
import xxhash

from lightning_wsync._control.manifest import Manifest, checksum
from lightning_wsync._control.store import Control
from lightning_wsync._planes.delta.codec import DeltaDecoder, DeltaError, DeltaHeader
from lightning_wsync._planes.delta.wire import DeltaStats, Held, held_of, ready_note, record_pieces
from lightning_wsync._planes.relay.down import Downstream
from lightning_wsync._planes.relay.hops import RELAY_RID, Superseded, chunks
from lightning_wsync._planes.shm.ring import Draft, SnapshotRing
from lightning_wsync._planes.wire import (
    DELTA,
    FULL,
    HEADER_WORDS,
    OVERWRITTEN,
    Arrival,
    Header,
    PeerGroup,
    Work,
    to_int64,
    trailer_words,
    verify,
)

log = logging.getLogger(__name__)

_RECV_WINDOW = 8  # chunk receives posted ahead of the one being waited for (4-32 MiB: hops.chunk_bytes)
_UNSENT = -7  # a header word no sent header has (its byte count): the header has not landed


class Message(NamedTuple):
    """One version as it came in on a hop, before its checks."""

    version: int
    seq: int
    delta: bool
    trailer: list[int]
    sums: list[int] | None  # checksums of the buckets as received or rebuilt; None: not rebuilt
    error: str | None  # why a delta was not rebuilt
    stats: DeltaStats


class Expected:
    """The next message's header receives, one per hop: watched as they land, waited on only then."""

    def __init__(self, pgs: Sequence[PeerGroup]) -> None:
        self._headers = [torch.full((HEADER_WORDS,), _UNSENT, dtype=torch.int64) for _ in pgs]  # kept alive
        self._works = [pg.recv([h], 0, 0) for pg, h in zip(pgs, self._headers)]
        self._left = False

    def landed(self, i: int) -> bool:
        """Whether hop ``i``'s header has started to land (:meth:`header` waits for all of it).

        Raises:
            Superseded: the hops were left (:meth:`leave`): a reader left behind ends here.
        """
        if self._left:
            raise Superseded(f"the hops of header {i} were left")
        return int(self._headers[i][2]) != _UNSENT

    def leave(self) -> None:
        self._left = True

    def arrived(self) -> bool:
        return any(self.landed(i) for i in range(len(self._headers)))

    def header(self, i: int) -> Header:
        """Hop ``i``'s header, once all of it is here."""
        self._works[i].wait()
        return Header.unpack(self._headers[i])


class HopReceiver:
    """A leader's one receive path, whatever the shape upstream: the host ring's draft each
    version is written into, the base a delta is rebuilt from, the headers it watches for,
    the trailer it forwards, the check and the resend of the version it holds.

    The shape upstream reads the body through it: :class:`ChainHop` (one hop, full or a delta)
    or :class:`~lightning_wsync._planes.relay.leader.treehop.TreeHop` (a tree's two halves at
    once). One receiver serves both shapes in turn, so the version it holds stays the base of
    the next delta when the chain becomes a tree, or back.
    """

    def __init__(self, layout: Manifest, ring: SnapshotRing | None = None) -> None:
        self.layout = layout
        self.staging = torch.zeros(layout.total_bytes, dtype=torch.uint8)  # touched now, not mid-receive
        self.held: Held | None = None  # what ``base`` holds intact between messages
        self.draft: Draft | None = None  # the host ring's slot the current message is written into
        self.pieces = chunks(layout)
        self.base = self.staging  # holds ``held``: the last version accepted (a slot of the ring, or staging)
        self.target = self.staging  # where the current message is written
        self._ring = ring
        self._accepted: tuple[int, int, list[int]] | None = None  # version, seq, trailer of what base holds
        self.expected: Expected | None = None  # the next message's header receives
        # Which version's receive a writer into the target belongs to: a tree's half thread left
        # behind by a superseded version must not post into, or rebuild into, a slot handed to a later one.
        self._generation = 0
        self._fence = threading.Lock()

    def ready_note(self) -> str:
        return ready_note(self.held, None)

    def expect(self, pgs: Sequence[PeerGroup]) -> Expected:
        """Post the next message's header receive on each hop, before the upstream side sends it.

        The hop needs no announcement on the store: the upstream side sends once this
        side's ``ready`` note is there, and its header lands here without a round trip
        through the store, whose replies queue behind the busy links of a push. Nothing
        waits on the receive (a wait would end at the group timeout while the chain is
        idle): :meth:`Expected.landed` watches the buffer instead.
        """
        self.expected = Expected(pgs)
        return self.expected

    def forget_headers(self) -> None:
        """The hops the headers were posted on are closed: whoever still watches one stops."""
        if self.expected is not None:
            self.expected.leave()
        self.expected = None

    def arrived(self) -> bool:
        """Whether any expected header has started to land."""
        return self.expected is not None and self.expected.arrived()

    def begin(self) -> tuple[Held | None, int]:
        """A version starts: take a free slot of the host ring as its draft (the private staging
        buffer when every slot is held). Returns what the base held before (a delta's base) and
        the version's generation (for :meth:`fenced`)."""
        held = self.held
        with self._fence:  # from here on, a writer of an earlier version writes nothing
            self._generation += 1
            generation = self._generation
        self.draft = None if self._ring is None else self._ring.draft()
        self.target = self.staging if self.draft is None else self.draft.buffer
        if self.target.data_ptr() == self.base.data_ptr():
            self.held = self._accepted = None  # rewritten in place from here on
        return held, generation

    @contextmanager
    def fenced(self, generation: int) -> Iterator[None]:
        """Held while a writer of version ``generation`` writes into the target (posts a receive,
        rebuilds a chunk); Superseded when a later version has taken the target since."""
        with self._fence:
            if generation != self._generation:
                raise Superseded(f"a later version (receive {self._generation}) has this slot")
            yield

    def post(self, pg: PeerGroup, i: int) -> Work:
        """Receive chunk ``i`` into the target."""
        a, b, _ = self.pieces[i]
        return pg.recv([self.target[a:b]], 0, 0)

    def trailer(self, pg: PeerGroup, downs: Sequence[tuple[Downstream, int | None]], *, rebuilt: bool) -> list[int]:
        """The trainer's trailer, forwarded down; marked (first word) for a next leader sent
        chunks this leader could not rebuild, so that it drops the version without a rejection."""
        trailer = torch.empty(trailer_words(len(self.layout.buckets)), dtype=torch.int64)
        pg.recv([trailer], 0, 0).wait()
        for down, mode in downs:
            if mode is not None:
                out = trailer
                if mode == FULL and not rebuilt:  # what went down is not this version: the next leader drops it
                    out = trailer.clone()
                    out[0] = OVERWRITTEN
                down.send(out)
        return [int(x) for x in trailer.tolist()]

    def check(self, ctl: Control, epoch: int, msg: Message) -> tuple[bool, str | None]:
        """Accept ``msg`` (the buffer it was written into then holds it) or say why not:
        (accepted, rejection reason or None)."""
        error = msg.error if msg.sums is not None or msg.error is not None else "not rebuilt"
        got = Arrival(msg.version, msg.seq, msg.trailer, msg.sums, error)
        verdict = verify(ctl, self.layout, epoch=epoch, rid=RELAY_RID, got=got, where=" on the relay")
        if not verdict.accepted:
            return False, verdict.reason
        self.held = None if verdict.sums is None else held_of(msg.version, verdict.sums)
        self.base = self.target
        self._accepted = (msg.version, msg.seq, msg.trailer)
        return True, None

    def resend(self, down: Downstream, pieces: Sequence[int]) -> int | None:
        """Send ``pieces`` of the version this leader holds on to a next leader that connected
        after that version went by (a chain re-formed under load); the version sent, or None
        when there is none to send.

        The trainer's trailer goes with it as it came, so the next leader checks the
        trainer's signature and checksums as for any version.
        """
        if self._accepted is None:
            return None
        version, seq, trailer = self._accepted
        if down.begin(version, seq, None, None) != FULL:
            return None
        for i in pieces:
            a, b, _ = self.pieces[i]
            down.send(self.base[a:b])
        down.send(torch.tensor(trailer, dtype=torch.int64))
        return version


class ChainHop:
    """A chain's shape upstream: one hop from the previous leader, each version in full or as a delta."""

    def __init__(self, receiver: HopReceiver) -> None:
        self.receiver = receiver
        self._bucket_pieces: list[list[tuple[int, int]]] = [[] for _ in receiver.layout.buckets]
        for a, b, bucket in receiver.pieces:
            self._bucket_pieces[bucket].append((a, b))

    def resend(self, down: Downstream) -> bool:
        """The version held, whole, to a next leader that connected after it went by."""
        version = self.receiver.resend(down, range(len(self.receiver.pieces)))
        if version is None:
            return False
        log.info("relay: version %d resent to a next leader that connected after it went by", version)
        return True

    def receive(self, pg: PeerGroup, down: Downstream) -> Message:
        """Receive the expected version, forwarding it as it comes; raises when the hop is out of step.

        The version is written into the receiver's draft (a free slot of the host ring: once
        verified it is published there with no copy) or, when every slot is held, into the
        private staging buffer. The caller commits or discards the draft after its check.
        """
        hop, layout = self.receiver, self.receiver.layout
        assert hop.expected is not None, "expect() first"
        header = hop.expected.header(0)
        header.check(layout.total_bytes, len(hop.pieces), len(layout.buckets))
        version, seq, kind = header.version, header.seq, header.kind
        held, _ = hop.begin()
        if kind == FULL:
            # The first chunks' receives are posted before the hop downstream is started: the
            # upstream side streams while this side deals with its own next hop. The rest
            # are posted a window ahead as chunks land (posting all 128 of a 64 MiB version
            # at once held the first chunk, and the next hop's header, back by ~40 ms here).
            works = deque(hop.post(pg, i) for i in range(min(_RECV_WINDOW, len(hop.pieces))))
            return self._receive_full(pg, works, version, seq, down.begin(version, seq, None, None), down)
        raw = torch.empty(DeltaHeader.SIZE, dtype=torch.uint8)
        pg.recv([raw], 0, 0).wait()
        try:
            delta: DeltaHeader | None = DeltaHeader.unpack(raw.numpy().tobytes())
            error = None
        except DeltaError as exc:
            delta, error = None, str(exc)
        mode = down.begin(version, seq, delta, raw)
        return self._receive_delta(pg, version, seq, held, delta, error, mode, down)

    def _receive_full(
        self, pg: PeerGroup, works: deque[Work], version: int, seq: int, mode: int | None, down: Downstream
    ) -> Message:
        hop = self.receiver
        staging, layout, pieces = hop.target, hop.layout, hop.pieces
        sums: list[int] = []
        hasher = xxhash.xxh3_64()
        last = {bucket: i for i, (_, _, bucket) in enumerate(pieces)}
        for i, (a, b, bucket) in enumerate(pieces):
            works.popleft().wait()
            if i + len(works) + 1 < len(pieces):
                works.append(hop.post(pg, i + len(works) + 1))
            if mode is not None:
                down.send(staging[a:b])
            # Hash chunk by chunk after forwarding it: a whole bucket hashed at once would hold
            # the next chunks back from the next hop (xxh3 streamed equals xxh3 in one go).
            hasher.update(staging[a:b].numpy().data)
            if last[bucket] == i:
                sums.append(to_int64(hasher.intdigest()))
                hasher = xxhash.xxh3_64()
        trailer = hop.trailer(pg, [(down, mode)], rebuilt=True)
        stats = DeltaStats(changed_share=1.0, wire_bytes=layout.total_bytes, full_bytes=layout.total_bytes)
        return Message(version, seq, False, trailer, sums, None, stats)

    def _receive_delta(
        self, pg: PeerGroup, version: int, seq: int, held: Held | None, delta: DeltaHeader | None,
        error: str | None, mode: int | None, down: Downstream,
    ) -> Message:  # fmt: skip
        """Rebuild a delta from the base (holding ``held``) into the target (may be the same buffer)."""
        hop = self.receiver
        out, base, layout = hop.target, hop.base, hop.layout
        stats = DeltaStats(wire_bytes=DeltaHeader.SIZE, full_bytes=layout.total_bytes)
        decoder: DeltaDecoder | None = None
        if delta is not None:
            try:
                decoder = DeltaDecoder(layout, delta, held_version=None if held is None else held.version,
                                       held_digest=None if held is None else held.digest)  # fmt: skip
            except DeltaError as exc:
                error = str(exc)
        sums: list[int] = []
        changed = 0
        for i, (a, b) in enumerate(layout.buckets):
            size = torch.empty(1, dtype=torch.int64)
            pg.recv([size], 0, 0).wait()
            n = int(size[0])
            if not 0 < n <= b - a + 64:  # a literal record: the bucket and its record header
                raise RuntimeError(f"version {version}: delta record {i} claims {n} bytes; the hop is out of step")
            body = torch.empty(n, dtype=torch.uint8)
            pieces = record_pieces(n)
            works = [pg.recv([body[pa:pb]], 0, 0) for pa, pb in pieces]
            if mode == DELTA:
                down.send(size)
            for (pa, pb), work in zip(pieces, works):
                work.wait()
                if mode == DELTA:  # forwarded as it arrives: a large record pipelines across hops
                    down.send(body[pa:pb])
            stats.wire_bytes += 8 + n
            if decoder is not None:
                start = time.perf_counter()
                try:
                    decoded = decoder.decode_bucket(body.numpy().data, base, out)
                    if decoded.bucket != i:
                        raise DeltaError(f"delta record {i} names bucket {decoded.bucket}")
                    changed += decoded.changed
                    sums.append(to_int64(checksum(out, a, b)))
                except DeltaError as exc:
                    error, decoder = str(exc), None
                stats.decode_s += time.perf_counter() - start
            if mode == FULL:
                for pa, pb in self._bucket_pieces[i]:
                    down.send(out[pa:pb])
        if delta is not None:
            stats.changed_share = changed / max(1, layout.total_bytes // delta.word_bytes)
        trailer = hop.trailer(pg, [(down, mode)], rebuilt=decoder is not None)
        return Message(version, seq, True, trailer, None if decoder is None else sums, error, stats)
