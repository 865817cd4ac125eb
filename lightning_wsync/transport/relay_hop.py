"""A host leader's hops: receive each version from upstream, rebuild and verify it, forward it downstream.

The leader's staging buffer holds the version being received and, between messages, the
last version it accepted: the base of the next delta, rebuilt in place (no second copy).
What goes downstream is decided per message from the next leader's ``ready`` note:

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
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import torch
import xxhash

from lightning_wsync import _keys as keys
from lightning_wsync._control import Control
from lightning_wsync._manifest import Manifest, checksum
from lightning_wsync.transport.delta import DeltaDecoder, DeltaError, DeltaHeader
from lightning_wsync.transport.delta_link import (
    DeltaStats,
    Held,
    held_of,
    parse_ready_note,
    ready_note,
    record_pieces,
)
from lightning_wsync.transport.group import (
    MAC_WORDS,
    PeerGroup,
    Work,
    shutdown_group,
    sums_mismatch,
    to_int64,
    trailer_signed,
)
from lightning_wsync.transport.relay import (
    CHAIN_POLL_S,
    DELTA,
    FULL,
    HEADER_WORDS,
    POLL_S,
    RELAY_RID,
    Chain,
    Superseded,
    chunks,
    error_text,
    hop_header,
    join_hop,
    read_chain,
)
from lightning_wsync.transport.ring import Draft, SnapshotRing

log = logging.getLogger(__name__)



_DOWNSTREAM_CONNECT_S = 2.0  # a version arriving before the next hop is connected waits this long for it
# The next leader's ready note is polled every POLL_S for _NOTE_HURRY_S after a version
# went down (it writes the note once it has taken that version in) and while begin()
# waits for it, else every CHAIN_POLL_S: fast polls throughout a push cost the store
# thousands of requests a second at 8 hosts.
_NOTE_HURRY_S = 0.5
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
        header = self._header
        version, seq, total, pieces, kind = (int(x) for x in header)
        want = len(self._pieces) if kind == FULL else len(layout.buckets)
        if kind not in (FULL, DELTA) or total != layout.total_bytes or pieces != want:
            raise RuntimeError(f"version {version}: layout mismatch ({total} bytes, {pieces} pieces, kind {kind})")
        held = self.held
        self.draft = None if self._ring is None else self._ring.draft()
        self._target = self.staging if self.draft is None else self.draft.buffer
        if self._target.data_ptr() == self._base.data_ptr():
            self.held = None  # rewritten in place from here on
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
        trailer = torch.empty(1 + len(self.layout.buckets) + MAC_WORDS, dtype=torch.int64)
        pg.recv([trailer], 0, 0).wait()
        if mode is not None:
            out = trailer
            if mode == FULL and not rebuilt:  # what went down is not this version: the next leader drops it
                out = trailer.clone()
                out[0] = -1
            down.send(out)
        return [int(x) for x in trailer.tolist()]

    def check(self, ctl: Control, epoch: int, msg: Message) -> tuple[bool, str | None]:
        """Accept ``msg`` (the buffer it was written into then holds it) or say why not:
        (accepted, rejection reason or None)."""
        nb = len(self.layout.buckets)
        values = msg.trailer
        if values[0] != msg.seq:
            log.debug("relay: version %d was overwritten on the trainer during its send, or not rebuilt upstream",
                      msg.version)  # fmt: skip
            return False, None
        sent, mac = values[1 : 1 + nb], values[1 + nb :]
        if not trailer_signed(ctl, epoch, RELAY_RID, msg.version, msg.seq, sent, mac):
            return False, "relayed trailer not signed with this job's secret (secret= / WSYNC_SECRET)"
        if msg.error is not None or msg.sums is None:
            return False, f"delta not applied on the relay ({msg.error}); the next version comes in full"
        mismatch = sums_mismatch(self.layout.buckets, msg.sums, sent, where=" on the relay")
        if mismatch is not None:
            return False, mismatch
        self.held = held_of(msg.version, [s & (2**64 - 1) for s in sent])
        self._base = self._target
        self._accepted = (msg.version, msg.seq, values)
        return True, None

    def resend(self, down: Downstream) -> bool:
        """Send the version this leader holds on to a next leader that connected after that
        version went by (a chain re-formed under load); False when there is none to send.

        The trainer's trailer goes with it as it came, so the next leader checks the
        trainer's signature and checksums as for any version.
        """
        if self.held is None or self._accepted is None or self._accepted[0] != self.held.version:
            return False
        version, seq, trailer = self._accepted
        if down.begin(version, seq, None, None) != FULL:
            return False
        for a, b, _ in self._pieces:
            down.send(self._base[a:b])
        down.send(torch.tensor(trailer, dtype=torch.int64))
        log.info("relay: version %d resent to a next leader that connected after it went by", version)
        return True


class Downstream:
    """This leader's hop to the next one in the chain: connected in the background, never waited on long."""

    def __init__(
        self, ctl: Control, epoch: int, chain: Chain, pos: int, layout: Manifest, backend: str, addr: str,
        timeout_s: float,
    ) -> None:  # fmt: skip
        self._ctl = ctl
        self._epoch = epoch
        self._layout = layout
        self._timeout_s = timeout_s
        self._rid = chain.rids[pos + 1] if pos + 1 < len(chain.rids) else None
        self._prefix = None if self._rid is None else keys.relay_hop_prefix(epoch, chain.gen, self._rid)
        self._pg: PeerGroup | None = None
        self._works: list[object] = []
        self._sending: list[torch.Tensor] = []  # kept alive until their sends complete
        self._n = 0  # messages started on this hop
        self._broken = False
        self._ready = threading.Event()
        self._closed = threading.Event()
        self._notes: dict[int, Held | None] = {}  # n -> what the next leader holds, read ahead of message n
        self._notes_end: BaseException | None = None  # why no more notes come
        self._notes_cv = threading.Condition()
        self._hurry_until = time.monotonic() + _NOTE_HURRY_S  # poll the next note fast until then
        self._wake = threading.Event()  # cuts a slow poll short (begin() waits, or close())
        self._gen = chain.gen
        self.missed = False  # a version went by while this hop was still connecting
        self._connector: threading.Thread | None = None
        if self._rid is not None:
            self._connector = threading.Thread(
                target=self._connect, args=(backend, addr), name=f"wsync-relay-down-{self._rid}", daemon=True
            )
            self._connector.start()

    def _connect(self, backend: str, addr: str) -> None:
        assert self._prefix is not None
        ctl = self._ctl.clone()

        def superseded() -> bool:
            current = read_chain(ctl, self._epoch)
            return self._closed.is_set() or current is None or current.gen != self._gen

        try:
            self._pg = join_hop(ctl, self._prefix, 0, backend, addr, self._timeout_s, superseded)
        except Superseded:
            pass
        except Exception as exc:  # noqa: BLE001 - the next leader never came: drop it from the chain
            self._fail(exc)
        finally:
            self._ready.set()
        if self._pg is not None:
            self._read_notes(ctl, superseded)

    def _read_notes(self, ctl: Control, superseded: Callable[[], bool]) -> None:
        """Read the next leader's ``ready`` notes as it writes them, so that forwarding a
        version costs no store round trip (the store's replies queue behind a busy link)."""
        assert self._prefix is not None
        n = 0
        next_check = 0.0
        end: BaseException = Superseded(self._prefix)
        try:
            while not self._closed.is_set():
                key = keys.ready(self._prefix, n)
                if ctl.has(key):
                    held, _ = parse_ready_note(ctl.get_raw(key).decode())
                    ctl.delete(key)
                    with self._notes_cv:
                        self._notes[n] = held
                        self._notes_cv.notify_all()
                    n += 1
                    continue
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + CHAIN_POLL_S
                    if superseded():
                        break
                self._wake.wait(POLL_S if now < self._hurry_until else CHAIN_POLL_S)
                self._wake.clear()
        except Exception as exc:  # noqa: BLE001 - store trouble: the next begin() reports it
            end = exc
        with self._notes_cv:
            self._notes_end = end
            self._notes_cv.notify_all()

    def _next_note(self) -> Held | None:
        """What the next leader holds before message ``self._n``; raises past ``timeout_s``."""
        deadline = time.monotonic() + self._timeout_s
        with self._notes_cv:
            if self._n not in self._notes:
                self._hurry_until = float("inf")
                self._wake.set()
            while self._n not in self._notes:
                if self._notes_end is not None:
                    raise self._notes_end
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"leader rid={self._rid} not ready for the next version "
                                       f"within timeout_s={self._timeout_s}")  # fmt: skip
                self._notes_cv.wait(min(left, CHAIN_POLL_S))
            self._hurry_until = 0.0
            return self._notes.pop(self._n)

    def _fail(self, exc: BaseException) -> None:
        if not self._broken and self._rid is not None:
            self._broken = True
            log.warning("relay: hop to leader rid=%d failed: %s", self._rid, error_text(exc))
            try:
                self._ctl.set_text(keys.relay_broken(self._epoch, self._rid), "1")
            except RuntimeError:
                pass

    def begin(self, version: int, seq: int, delta: DeltaHeader | None, raw: torch.Tensor | None) -> int | None:
        """Start ``version`` downstream; how it goes (FULL, DELTA), or None when there is no usable next hop.

        A delta goes on as a delta only when the next leader holds its exact base.
        """
        if self._rid is None or self._broken:
            return None
        if not self._ready.wait(_DOWNSTREAM_CONNECT_S) or self._pg is None:
            self.missed = self._pg is None and not self._ready.is_set()  # still connecting: resent once connected
            return None
        self.missed = False
        assert self._prefix is not None
        try:
            held = self._next_note()
            kind = FULL
            if delta is not None and raw is not None and held == Held(delta.base_version, delta.base_digest):
                kind = DELTA
            self._n += 1
            header = hop_header(version, seq, self._layout, kind)
            self._works, self._sending = [], []
            self.send(header)
            if kind == DELTA:
                assert raw is not None
                self.send(raw)
            log.debug("relay: version %d on to rid=%d %s", version, self._rid, "as a delta" if kind else "in full")
            return kind
        except Superseded:
            return None
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return None

    def send(self, piece: torch.Tensor) -> None:
        if self._broken or self._pg is None:
            return
        try:
            self._works.append(self._pg.send([piece], 1, 0))
            self._sending.append(piece)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def connected(self) -> bool:
        return self._pg is not None and not self._broken

    def finish(self) -> None:
        """Wait for this version's sends (bounded by the group timeout)."""
        works, self._works = self._works, []
        try:
            for work in works:
                try:
                    work.wait()  # type: ignore[attr-defined]
                except Exception as exc:  # noqa: BLE001
                    self._fail(exc)
                    return
        finally:
            self._sending = []
            self._hurry_until = time.monotonic() + _NOTE_HURRY_S

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        with self._notes_cv:
            self._notes_cv.notify_all()
        if self._connector is not None:
            self._connector.join(timeout=1.0)
        shutdown_group(self._pg)
