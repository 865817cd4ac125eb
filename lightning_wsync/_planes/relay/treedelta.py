"""Deltas on the edges of the two trees: each tree's half of a version as a delta, chunk by chunk.

A tree carries the version's chunks in its half (:func:`~lightning_wsync._planes.relay.plan.half`).
As a delta it carries, for the same chunks, one record each against the base the
downstream side holds: the records are cut by :func:`chunk_layout` (a "bucket" per chunk
of :func:`~lightning_wsync._planes.relay.hops.chunks`), not by the sender's buckets, so

- each edge picks its kind alone: a leader whose parent in tree 0 sends a delta and whose
  parent in tree 1 sends the full half (one of them did not hold the base) rebuilds the
  even chunks from its base and takes the odd ones as they come;
- a record is rebuilt as soon as it lands, in the thread that receives that tree's half,
  and the chunk is then forwarded in full to a child that does not hold the base, or the
  record as it came (before it is decoded) to a child that does.

On the wire, after the hop header (kind DELTA, one piece per chunk of the half): the
delta's header, then the half's records in batches of consecutive chunks (int64 [bytes,
records], then the batch: uint32 per record its length, the records; in pieces of
:func:`~lightning_wsync._planes.delta.wire.record_pieces`), then the trainer's trailer.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from lightning_wsync._control.manifest import Manifest
from lightning_wsync._planes.delta.codec import DeltaDecoder, DeltaError, DeltaHeader
from lightning_wsync._planes.delta.encode import DeltaStream
from lightning_wsync._planes.delta.wire import Held, record_pieces
from lightning_wsync._planes.relay.down import Downstream
from lightning_wsync._planes.relay.hops import chunks
from lightning_wsync._planes.wire import DELTA, FULL, PeerGroup, Work

# A tree's sends posted ahead of the one the sender waits for: a full half's chunks (views of
# the slot) all at once up to 128 MiB a half; a delta's batches as encoded.
_IN_FLIGHT = 256
# Records travel in batches of up to this many records or bytes: one message per record made
# a level cost ~64 gloo wake-ups per 32 MiB half on a busy machine (measured: 0.41 s a push at
# 8 hosts against 0.22 s on the chain, whose 32 MiB bucket is one record).
_BATCH_RECORDS = 16
_BATCH_BYTES = 1 << 18


def chunk_layout(layout: Manifest) -> Manifest:
    """``layout``'s bytes cut into the relay's chunks: the records of a tree's delta."""
    return Manifest(entries=layout.entries, buckets=tuple((a, b) for a, b, _ in chunks(layout)),
                    total_bytes=layout.total_bytes)  # fmt: skip


@dataclass
class HalfStats:
    """How one tree's half of a version came in."""

    delta: bool = False
    wire_bytes: int = 0
    changed_words: int = 0
    decode_s: float = 0.0
    error: str | None = None  # why a delta half was not rebuilt


# -- the sender's side -------------------------------------------------------------------
def half_messages(
    buffer: torch.Tensor, pieces: Sequence[tuple[int, int, int]], mine: Sequence[int], stream: DeltaStream | None
) -> Iterator[list[torch.Tensor]]:
    """What the sender sends to one tree's root after the hop header, a step at a time:
    the chunks of ``mine`` in full, or (``stream``) the delta's header and one record per chunk."""
    if stream is None:
        for i in mine:
            a, b, _ = pieces[i]
            yield [buffer[a:b]]
        return
    yield [torch.frombuffer(bytearray(stream.header.pack()), dtype=torch.uint8)]
    k = 0
    while k < len(mine):
        payloads: list[bytes] = []
        while k < len(mine) and len(payloads) < _BATCH_RECORDS and sum(map(len, payloads)) < _BATCH_BYTES:
            payloads.append(stream.record(mine[k]).payload)
            k += 1
        index = struct.pack(f"<{len(payloads)}I", *map(len, payloads))
        body = torch.frombuffer(bytearray(index + b"".join(payloads)), dtype=torch.uint8)
        yield [torch.tensor([body.numel(), len(payloads)], dtype=torch.int64)] + [
            body[a:b] for a, b in record_pieces(body.numel())
        ]


def send_halves(
    pgs: Sequence[PeerGroup], halves: Sequence[Iterator[list[torch.Tensor]]], progress: Callable[[], None],
    blame: Callable[[int], None],
) -> None:
    """Send both trees' halves, a step of each in turn (the trees progress together), with at
    most ``_IN_FLIGHT`` sends per tree outstanding; ``progress`` after each wait, ``blame(t)``
    before anything that may fail because of tree ``t``'s root."""
    works: list[deque[tuple[Work, torch.Tensor]]] = [deque() for _ in pgs]
    live = list(range(len(pgs)))
    while live:
        for t in list(live):
            blame(t)
            step = next(halves[t], None)
            if step is None:
                live.remove(t)
                continue
            works[t].extend((pgs[t].send([piece], 1, 0), piece) for piece in step)
            while len(works[t]) > _IN_FLIGHT:
                works[t].popleft()[0].wait()
                progress()
    for t, pending in enumerate(works):
        blame(t)
        while pending:
            pending.popleft()[0].wait()
            progress()


# -- a leader's side ---------------------------------------------------------------------
class _Batch:
    """The receive of the next batch's size (bytes, records), posted ahead of the batch before it."""

    def __init__(self, pg: PeerGroup) -> None:
        self._pg = pg
        self.post()

    def post(self) -> None:
        self._tensor = torch.empty(2, dtype=torch.int64)
        self._work = self._pg.recv([self._tensor], 0, 0)

    def take(self) -> tuple[int, int, torch.Tensor]:
        """(bytes, records) once landed, and the tensor, to forward."""
        self._work.wait()
        return int(self._tensor[0]), int(self._tensor[1]), self._tensor


class DeltaHalf:
    """One tree's half of a version that comes as a delta: received, forwarded, rebuilt chunk by chunk.

    ``base`` holds ``held`` (the version the leader accepted last); each chunk is rebuilt
    into ``target`` (``base`` itself when the ring had no other free slot: the halves' chunks
    are disjoint, so rebuilding in place never reads a chunk already rewritten).
    """

    def __init__(
        self, layout: Manifest, mine: Sequence[int], *, held: Held | None, base: torch.Tensor, target: torch.Tensor,
        fence: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:  # fmt: skip
        """``fence``: held while a chunk is rebuilt into ``target`` (raises once the target was handed on)."""
        self._fence = fence
        self._layout = layout  # chunk_layout of the version's layout
        self._mine = mine
        self._held = held
        self._base = base
        self._target = target
        self.stats = HalfStats(delta=True)

    def receive(
        self, pg: PeerGroup, version: int, seq: int, downs: Sequence[Downstream], landed: Sequence[threading.Event],
    ) -> list[int | None]:  # fmt: skip
        """The delta's header and records (each chunk marked in ``landed`` once rebuilt); how each
        of ``downs`` is served (DELTA: the records as they came, FULL: the rebuilt chunks)."""
        raw = torch.empty(DeltaHeader.SIZE, dtype=torch.uint8)
        pg.recv([raw], 0, 0).wait()
        self.stats.wire_bytes = DeltaHeader.SIZE
        decoder: DeltaDecoder | None = None
        header: DeltaHeader | None = None
        held = self._held
        try:
            header = DeltaHeader.unpack(raw.numpy().tobytes())
            decoder = DeltaDecoder(self._layout, header, held_version=None if held is None else held.version,
                                   held_digest=None if held is None else held.digest)  # fmt: skip
        except DeltaError as exc:
            self.stats.error = str(exc)
        modes = [d.begin(version, seq, header, raw if header is not None else None) for d in downs]
        batch = _Batch(pg)
        k = 0
        while k < len(self._mine):
            count, decoder = self._batch(pg, k, batch, decoder, list(zip(downs, modes)), landed)
            k += count
        return modes

    def _batch(
        self, pg: PeerGroup, k: int, batch: _Batch, decoder: DeltaDecoder | None,
        downs: list[tuple[Downstream, int | None]], landed: Sequence[threading.Event],
    ) -> tuple[int, DeltaDecoder | None]:  # fmt: skip
        """The batch of records from the ``k``-th chunk of this half on: its size (received
        ahead), its bytes, forwarded as they arrive; then each record rebuilt in turn. The next
        batch's size is posted before this one is waited for. Returns how many records it held."""
        n, count, meta = batch.take()
        chunks = self._mine[k : k + count]
        bound = sum(b - a + 64 + 4 for a, b in (self._layout.buckets[i] for i in chunks))
        if not (0 < count <= len(self._mine) - k and 4 * count < n <= bound):
            raise RuntimeError(f"a batch of {count} delta records in {n} bytes from chunk {k} of this half; "
                               f"the hop is out of step")  # fmt: skip
        body = torch.empty(n, dtype=torch.uint8)
        pieces = record_pieces(n)
        works = [pg.recv([body[pa:pb]], 0, 0) for pa, pb in pieces]
        if k + count < len(self._mine):
            batch.post()
        forward = [d for d, mode in downs if mode == DELTA]
        for down in forward:
            down.send(meta)
        for (pa, pb), work in zip(pieces, works):
            work.wait()
            for down in forward:  # as it arrives: a record crosses a level before it is decoded
                down.send(body[pa:pb])
        self.stats.wire_bytes += meta.numel() * 8 + n
        data = body.numpy().data
        lengths = struct.unpack_from(f"<{count}I", data)
        if 4 * count + sum(lengths) != n:
            raise RuntimeError(f"a batch of {count} delta records claims {sum(lengths)} bytes in {n}; out of step")
        offset = 4 * count
        for i, length in zip(chunks, lengths):
            decoder = self._record(i, data[offset : offset + length], decoder, downs)
            offset += length
            landed[i].set()
        return count, decoder

    def _record(
        self, i: int, record: memoryview, decoder: DeltaDecoder | None, downs: list[tuple[Downstream, int | None]]
    ) -> DeltaDecoder | None:
        """Chunk ``i`` rebuilt from its record (unless an earlier one failed), then sent on in
        full to the children that take it so."""
        a, b = self._layout.buckets[i]
        if decoder is not None:
            start = time.perf_counter()
            try:
                with self._fence():
                    decoded = decoder.decode_bucket(record, self._base, self._target)
                if decoded.bucket != i:
                    raise DeltaError(f"the delta record of chunk {i} names chunk {decoded.bucket}")
                self.stats.changed_words += decoded.changed
            except DeltaError as exc:
                self.stats.error, decoder = str(exc), None
            self.stats.decode_s += time.perf_counter() - start
        for down, mode in downs:
            if mode == FULL:  # not rebuilt: the trailer it gets says so (see TreeHop)
                down.send(self._target[a:b])
        return decoder
