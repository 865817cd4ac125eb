"""A host leader's receiving side: receive each version from upstream, rebuild and verify it, forward it.

Each version is written straight into a free slot of the host's ring (a draft, published
with no copy once verified; a private staging buffer when every slot is held). The
buffer holding the last version accepted is the base of the next delta, which is rebuilt
from it into the new slot (in place when the base's slot is the only free one). The hop
downstream is :class:`~lightning_wsync._planes.relay.down.Downstream`. What goes
downstream is decided per message from the next leader's ``ready`` note:

- a full version arrives: forwarded chunk by chunk as it arrives;
- a delta arrives and the next leader holds its base: the records are forwarded as they
  arrive, before this leader decodes them, so a delta crosses the chain about as fast
  as one record per hop;
- a delta arrives and the next leader holds anything else: each bucket is forwarded as
  soon as it is rebuilt here, as a full version. When this leader cannot rebuild it,
  the trailer it forwards says so (first word -1) and the next leader drops the version
  without a rejection; the trailer's signed words are forwarded as they came.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import NamedTuple

import torch
import xxhash

from lightning_wsync._control.manifest import Manifest, checksum
from lightning_wsync._control.store import Control
from lightning_wsync._planes.delta.codec import DeltaDecoder, DeltaError, DeltaHeader
from lightning_wsync._planes.delta.wire import DeltaStats, Held, held_of, ready_note, record_pieces
from lightning_wsync._planes.relay.down import Downstream
from lightning_wsync._planes.relay.hops import RELAY_RID, chunks
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

_RECV_WINDOW = 8  # chunk receives posted ahead of the one being waited for (4 MiB)
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


class HopReceiver:
    """A leader's receiving side: stages, rebuilds, forwards and checks one version at a time."""

    def __init__(self, layout: Manifest, ring: SnapshotRing | None = None) -> None:
        self.layout = layout
        self.staging = torch.zeros(layout.total_bytes, dtype=torch.uint8)  # touched now, not mid-receive
        self.held: Held | None = None  # what ``_base`` holds intact between messages
        self.draft: Draft | None = None  # the host ring's slot the current message is written into
        self._ring = ring
        self._base = self.staging  # holds ``held``: the last version accepted (a slot of the ring, or staging)
        self._target = self.staging  # where the current message is written
        self._accepted: tuple[int, int, list[int]] | None = None  # version, seq, trailer of what _base holds
        self._pieces = chunks(layout)
        self._header = torch.empty(HEADER_WORDS, dtype=torch.int64)
        self._header_work: Work | None = None
        self._bucket_pieces: list[list[tuple[int, int]]] = [[] for _ in layout.buckets]
        for a, b, bucket in self._pieces:
            self._bucket_pieces[bucket].append((a, b))

    def ready_note(self) -> str:
        return ready_note(self.held, None)

    def expect(self, pg: PeerGroup) -> None:
        """Post the next message's header receive, before the upstream side sends it.

        The hop needs no announcement on the store: the upstream side sends once this
        side's ``ready`` note is there, and its header lands here without a round trip
        through the store, whose replies queue behind the busy links of a push. Nothing
        waits on the receive (a wait would end at the group timeout while the chain is
        idle): :meth:`arrived` watches the buffer instead.
        """
        self._header = torch.full((HEADER_WORDS,), _UNSENT, dtype=torch.int64)  # kept alive with the group
        self._header_work = pg.recv([self._header], 0, 0)

    def arrived(self) -> bool:
        """Whether the expected header has started to land (:meth:`receive` waits for all of it)."""
        return int(self._header[2]) != _UNSENT

    def receive(self, pg: PeerGroup, down: Downstream) -> Message:
        """Receive the expected version, forwarding it as it comes; raises when the hop is out of step.

        The version is written into :attr:`draft` (a free slot of the host ring: once
        verified it is published there with no copy) or, when every slot is held, into the
        private staging buffer. The caller commits or discards the draft after :meth:`check`.
        """
        layout = self.layout
        assert self._header_work is not None, "expect() first"
        self._header_work.wait()
        self._header_work = None
        header = Header.unpack(self._header)
        header.check(layout.total_bytes, len(self._pieces), len(layout.buckets))
        version, seq, kind = header.version, header.seq, header.kind
        held = self.held
        self.draft = None if self._ring is None else self._ring.draft()
        self._target = self.staging if self.draft is None else self.draft.buffer
        if self._target.data_ptr() == self._base.data_ptr():
            self.held = self._accepted = None  # rewritten in place from here on
        if kind == FULL:
            # The first chunks' receives are posted before the hop downstream is started: the
            # upstream side streams while this side deals with its own next hop. The rest
            # are posted a window ahead as chunks land (posting all 128 of a 64 MiB version
            # at once held the first chunk, and the next hop's header, back by ~40 ms here).
            works = deque(self._post(pg, i) for i in range(min(_RECV_WINDOW, len(self._pieces))))
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

    def _post(self, pg: PeerGroup, i: int) -> Work:
        a, b, _ = self._pieces[i]
        return pg.recv([self._target[a:b]], 0, 0)

    def _receive_full(
        self, pg: PeerGroup, works: deque[Work], version: int, seq: int, mode: int | None, down: Downstream
    ) -> Message:
        staging, layout, pieces = self._target, self.layout, self._pieces
        sums: list[int] = []
        hasher = xxhash.xxh3_64()
        last = {bucket: i for i, (_, _, bucket) in enumerate(pieces)}
        for i, (a, b, bucket) in enumerate(pieces):
            works.popleft().wait()
            if i + len(works) + 1 < len(pieces):
                works.append(self._post(pg, i + len(works) + 1))
            if mode is not None:
                down.send(staging[a:b])
            # Hash chunk by chunk after forwarding it: a whole bucket hashed at once would hold
            # the next chunks back from the next hop (xxh3 streamed equals xxh3 in one go).
            hasher.update(staging[a:b].numpy().data)
            if last[bucket] == i:
                sums.append(to_int64(hasher.intdigest()))
                hasher = xxhash.xxh3_64()
        trailer = self._trailer(pg, down, mode, rebuilt=True)
        stats = DeltaStats(changed_share=1.0, wire_bytes=layout.total_bytes, full_bytes=layout.total_bytes)
        return Message(version, seq, False, trailer, sums, None, stats)

    def _receive_delta(
        self, pg: PeerGroup, version: int, seq: int, held: Held | None, delta: DeltaHeader | None,
        error: str | None, mode: int | None, down: Downstream,
    ) -> Message:  # fmt: skip
        """Rebuild a delta from ``_base`` (holding ``held``) into ``_target`` (may be the same buffer)."""
        out, base, layout = self._target, self._base, self.layout
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
        trailer = self._trailer(pg, down, mode, rebuilt=decoder is not None)
        return Message(version, seq, True, trailer, None if decoder is None else sums, error, stats)

    def _trailer(self, pg: PeerGroup, down: Downstream, mode: int | None, *, rebuilt: bool) -> list[int]:
        trailer = torch.empty(trailer_words(len(self.layout.buckets)), dtype=torch.int64)
        pg.recv([trailer], 0, 0).wait()
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
        self._base = self._target
        self._accepted = (msg.version, msg.seq, msg.trailer)
        return True, None

    def resend(self, down: Downstream) -> bool:
        """Send the version this leader holds on to a next leader that connected after that
        version went by (a chain re-formed under load); False when there is none to send.

        The trainer's trailer goes with it as it came, so the next leader checks the
        trainer's signature and checksums as for any version.
        """
        if self._accepted is None:
            return False
        version, seq, trailer = self._accepted
        if down.begin(version, seq, None, None) != FULL:
            return False
        for a, b, _ in self._pieces:
            down.send(self._base[a:b])
        down.send(torch.tensor(trailer, dtype=torch.int64))
        log.info("relay: version %d resent to a next leader that connected after it went by", version)
        return True
