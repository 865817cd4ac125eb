"""Relay hops over NIXL: a host leader READs each version from the upstream ring, chunk by chunk.

The upstream is the trainer's ring (its :class:`~lightning_wsync._planes.nixl.send.NixlSendPlane`,
which signs a hop reader's trailers for ``RELAY_RID``) or the previous leader's host ring,
lent by that leader's :class:`HopOwner`. A leader's :class:`ChainHop` READs straight into a
draft slot of its own host ring, and lends that draft downstream *while it is being
written*: the next leader is granted it with the bytes landed so far, told of each chunk
that lands (``L``) and of the end (``K``: verified and published; ``D``: dropped), so a
version crosses the chain about one chunk per hop behind the first (pipelined as the gloo
relay is). Every reader hashes each bucket as its chunks land and checks the version
against the trainer's signed trailer (:func:`~lightning_wsync._planes.wire.verify`), then
READs the slot's sequence and version words: a slot that moved under the READ is never
applied. The owner's side, and its leases, is :mod:`.lend`.

Longer than 300 lines: one hop's pin, its chunk READs and the upstream's notes about them
share the hop's state (the current pin's inbox), on one thread.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from lightning_wsync._control import keys
from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.records import NixlAgentRecord
from lightning_wsync._control.store import Control
from lightning_wsync._planes.nixl import messages
from lightning_wsync._planes.nixl.agent import Agent, Failures, NixlError, NotPublished
from lightning_wsync._planes.nixl.lend import HopOwner
from lightning_wsync._planes.shm.ring import Draft, SnapshotRing
from lightning_wsync._planes.shm.segment import ShmSegment, SlotRef, seq_word_offset
from lightning_wsync._planes.wire import Arrival, to_int64, verify
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)

HOP_CHUNK_BYTES = 4 << 20  # one READ, and the unit a draft is lent downstream in
_WINDOW = 4  # chunk READs in flight
_POLL_S = 0.0002
_IDLE_POLL_S = 0.005
_LEAD_POLL_S = 0.05  # a leading hop looks for a new chain this often


def hop_reader_name(rid: int, pid: int, token: str) -> str:
    return f"wsync-h{rid}-{pid}-{token}"  # send._READER: "h" readers get RELAY_RID trailers


def hop_chunks(layout: Manifest, chunk_bytes: int) -> list[tuple[int, int, int]]:
    """``(start, end, bucket)`` READs of at most ``chunk_bytes``, never straddling a bucket."""
    step = max(1 << 16, chunk_bytes)
    return [(s, min(b, s + step), i) for i, (a, b) in enumerate(layout.buckets) for s in range(a, b, step)]


class Dropped(Exception):
    """The upstream leader gave the version up, or its slot moved under the READ: not applied, not rejected."""


@dataclass
class _Inbox:
    grant: messages.HopGrant | None = None
    nothing: bool = False
    landed: int = 0
    end: str | None = None  # "K" | "D"


class ChainHop:
    """A leader's hop from upstream over NIXL: READ each version into a draft of its host ring,
    lending it downstream as it lands (its :attr:`owner`), verify, publish.

    ``upstream``: the previous leader's rid, or None for the trainer's ring. ``on_accepted``
    and ``on_rejected`` run on this hop's thread once a version is published or refused.
    """

    def __init__(
        self, ctl: Control, layout: Manifest, ring: SnapshotRing, segment: ShmSegment, *, stream: int, rid: int,
        upstream: int | None, timeout_s: float, on_accepted: Callable[[int], None],
        on_rejected: Callable[[int, str], None], chunk_bytes: int = HOP_CHUNK_BYTES, have: int | None = None,
    ) -> None:  # fmt: skip
        self._ctl = ctl
        self.layout = layout
        self._ring = ring
        self._stream = stream
        self._rid = rid
        self._upstream = upstream
        self._timeout_s = timeout_s
        self._on_accepted = on_accepted
        self._on_rejected = on_rejected
        self._chunks = hop_chunks(layout, chunk_bytes)
        self._words = torch.zeros(2, dtype=torch.int64)
        self.owner = HopOwner(ctl, ring, segment, stream=stream, rid=rid)
        self._agent = Agent(hop_reader_name(rid, os.getpid(), secrets.token_hex(4)))
        self._key = keys.nixl_agent(stream, f"h{rid}")
        try:
            self._agent.register([*segment.data, self._words])
            ctl.put(self._key, self._agent.record())
        except BaseException:
            self._agent.close()
            self.owner.close()
            raise
        self._up: NixlAgentRecord | None = None
        self._source = upstream  # the upstream the current pin was asked of
        self._tag = 0
        self._inbox = _Inbox()
        self.version: int | None = have  # the newest version published here
        self.reading: int | None = None  # the version being READ now
        self.from_draft = False  # whether it was lent while still being written upstream (pipelined)
        self._refused: int | None = None
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"wsync-nixl-hop-{rid}", daemon=True)
        self._thread.start()

    def lead(self, upstream: int | None, superseded: Callable[[], bool]) -> None:
        """READ from ``upstream`` from now on (a new chain), until ``superseded()`` (the relay's seam,
        leader/member.py); the agents stay, so the next leader's cached record of this one stays good."""
        self._upstream = upstream
        while not superseded():
            time.sleep(_LEAD_POLL_S)

    # -- the hop's thread ---------------------------------------------------------------
    def _run(self) -> None:
        failures = Failures(self._timeout_s)
        following = self._upstream
        while not self._stop.is_set():
            if self._upstream != following:  # a new chain: another upstream
                following = self._upstream
                self._forget_upstream()
            self._source = following
            try:
                if not self._fetch():
                    self._stop.wait(_IDLE_POLL_S)
                failures.cleared()
            except Dropped as exc:
                log.debug("NIXL hop rid=%d: %s", self._rid, exc)
            except Exception as exc:  # noqa: BLE001 - a hop thread that died would stop its stream here for good
                level = failures.failed(exc)
                self.error = failures.last
                if not self._stop.is_set():
                    log.log(level, "NIXL hop rid=%d (stream %d): %s", self._rid, self._stream, exc)
                self._forget_upstream()
                self._stop.wait(min(1.0, 0.05 * 2**failures.count))

    def _upstream_record(self) -> NixlAgentRecord:
        if self._up is None:
            who = "sender" if self._source is None else f"leader{self._source}"
            record = self._ctl.get_record(keys.nixl_agent(self._stream, who), NixlAgentRecord)
            if record is None:
                raise NotPublished(f"the upstream ({who}) published no NIXL agent")
            if len(record.regions) < 2 or {n for _, n in record.regions[1:]} != {self.layout.total_bytes}:
                raise NixlError(f"the upstream's NIXL record lists regions {record.regions!r:.80} that do not fit")
            self._agent.add_remote(record)
            self._up = record
        return self._up

    def _forget_upstream(self) -> None:
        if self._up is not None:
            self._agent.remove_remote(self._up.name)
            self._up = None

    def _pump(self, peer: str) -> None:
        """Take the upstream's notifications for the current pin into :attr:`_inbox`."""
        box = self._inbox
        for note in self._agent.messages().get(peer, []):
            parsed = messages.parse(note)
            if parsed is None or parsed[1][0] != self._tag:
                continue  # an answer to an earlier pin
            kind, numbers = parsed
            if kind == "N":
                box.nothing = True
            elif kind == "G" and (g := messages.as_grant(numbers)) is not None:  # the trainer's ring: published
                box.grant = messages.HopGrant(g.tag, g.version, g.slot, g.seq, g.seq, 0, self.layout.total_bytes,
                                              g.trailer)  # fmt: skip
                box.landed = self.layout.total_bytes
            elif kind == "H" and (h := messages.as_hop_grant(numbers)) is not None:
                box.grant, box.landed = h, max(box.landed, h.landed)
            elif kind == "L" and len(numbers) == 2:
                box.landed = max(box.landed, numbers[1])
            elif kind in ("K", "D"):
                box.end = kind

    def _moved(self) -> None:
        """Give the current pin up when the hop is closing or a new chain names another upstream (its READs
        from the old one, maybe dead, would otherwise run to ``timeout_s`` before the new one is asked)."""
        if self._stop.is_set():
            raise Dropped("the hop is closing")
        if self._upstream != self._source:
            raise Dropped(f"a new chain: upstream {self._upstream} in place of {self._source}")

    def _wait(self, peer: str, until: Callable[[], bool], what: str, deadline: float) -> None:
        while not until():
            self._moved()
            if time.monotonic() > deadline:
                raise NixlError(f"{what} within timeout_s={self._timeout_s} (the upstream stalled or is gone)")
            self._pump(peer)
            time.sleep(_POLL_S)

    def _fetch(self) -> bool:
        """READ the next version above what this leader has; False when the upstream has none newer."""
        up = self._upstream_record()
        have = max((v for v in (self.version, self._refused) if v is not None), default=None)
        self._tag += 1
        self._inbox = box = _Inbox()
        self._agent.notify(up.name, messages.pin(self._tag, have))
        try:
            self._wait(up.name, lambda: box.grant is not None or box.nothing, "no answer to a pin",
                       time.monotonic() + self._timeout_s)  # fmt: skip
            grant = box.grant
            if grant is None:
                return False
            self._take(up, grant, box)
            return True
        finally:
            try:
                self._agent.notify(up.name, messages.unpin(self._tag))
            except NixlError as exc:
                log.debug("NIXL hop rid=%d: %s", self._rid, exc)

    def _draft(self) -> Draft:
        deadline = time.monotonic() + self._timeout_s
        while (draft := self._ring.draft()) is None:  # every slot held by host-mates: their pins expire
            if self._stop.is_set() or time.monotonic() > deadline:
                raise NixlError(f"no free slot in the host ring within timeout_s={self._timeout_s}")
            time.sleep(_IDLE_POLL_S)
        return draft

    def _take(self, up: NixlAgentRecord, grant: messages.HopGrant, box: _Inbox) -> None:
        if grant.slot + 1 >= len(up.regions):
            raise NixlError(f"the upstream granted slot {grant.slot}, which its record does not list")
        draft = self._draft()
        self.reading, self.from_draft = grant.version, bool(grant.draft)
        self.owner.begin(grant.version, draft.slot, self._ring.seq(draft.slot), grant.origin_seq, grant.trailer)
        published: SlotRef | None = None
        try:
            sums = self._read(up, grant, box, draft.buffer)
            got = Arrival(grant.version, grant.origin_seq, grant.trailer, sums, None)
            verdict = verify(self._ctl, self.layout, epoch=self._stream, rid=messages.RELAY_RID, got=got,
                             where=" on a NIXL hop")  # fmt: skip
            if not verdict.accepted:
                if verdict.reason is not None:
                    self._refused = grant.version
                    self._on_rejected(grant.version, verdict.reason)
                return
            published = draft.commit(grant.version)
        finally:
            if published is None:
                draft.discard()
            self.owner.end(published)
        self.version = grant.version
        self._on_accepted(grant.version)

    def _read(self, up: NixlAgentRecord, grant: messages.HopGrant, box: _Inbox, into: torch.Tensor) -> list[int]:
        """READ the granted slot chunk by chunk (each only once landed upstream), hashing every
        bucket as its chunks land; then its sequence and version words. The checksums."""
        base = up.regions[1 + grant.slot][0]
        local = into.data_ptr()
        todo = list(self._chunks)
        note = messages.touch(grant.tag)
        pending: list[tuple[Any, tuple[int, int, int]]] = []
        sums: list[int] = []
        hasher = xxhash.xxh3_64()
        nbuckets = len(self.layout.buckets)
        deadline = time.monotonic() + self._timeout_s  # renewed by each chunk that lands
        try:
            while todo or pending:
                self._pump(up.name)
                if box.end == "D":
                    raise Dropped(f"the upstream dropped version {grant.version}")
                while todo and len(pending) < _WINDOW and todo[0][1] <= box.landed:
                    a, b, bucket = todo.pop(0)
                    handle = self._agent.post_read(up.name, [(local + a, b - a)], [(base + a, b - a)], note)
                    pending.append((handle, (a, b, bucket)))
                if pending and self._agent.done(pending[0][0]):
                    handle, (a, b, bucket) = pending.pop(0)
                    self._agent.release(handle)
                    deadline = time.monotonic() + self._timeout_s
                    hasher.update(into[a:b].numpy().data)
                    if b == self.layout.buckets[bucket][1]:
                        sums.append(to_int64(hasher.intdigest()))
                        hasher = xxhash.xxh3_64()
                    self.owner.landed(b)
                    self.after_chunk()
                elif self._stop.is_set() or self._upstream != self._source:
                    self._moved()
                elif time.monotonic() > deadline:
                    raise NixlError(f"a chunk of version {grant.version} made no progress within "
                                    f"timeout_s={self._timeout_s} (the upstream stalled or is gone)")  # fmt: skip
                else:
                    time.sleep(_POLL_S)
            if grant.draft:
                self._wait(up.name, lambda: box.end is not None, f"the end of version {grant.version} upstream",
                           deadline)  # fmt: skip
                if box.end == "D":
                    raise Dropped(f"the upstream dropped version {grant.version}")
            words = self._agent.post_read(up.name, [(self._words.data_ptr(), 16)],
                                          [(up.regions[0][0] + seq_word_offset(grant.slot), 16)])  # fmt: skip
            pending.append((words, (0, 0, 0)))
            while not self._agent.done(words):
                if self._stop.is_set() or time.monotonic() > deadline:
                    raise NixlError(f"the READ of version {grant.version}'s slot words did not complete")
                time.sleep(_POLL_S)
        finally:
            for handle, _ in pending:
                self._agent.release(handle)
        seq, version = (int(w) for w in self._words.tolist())
        want = grant.seq + 1 if grant.draft else grant.seq
        if (seq, version) != (want, grant.version) or len(sums) != nbuckets:
            raise Dropped(f"version {grant.version}'s slot moved during the READ (sequence {want} -> {seq})")
        return sums

    def after_chunk(self) -> None:
        """Called after each chunk landed here (a seam for tests)."""

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._timeout_s + 1.0)
        self.owner.close()
        try:
            self._ctl.delete(self._key)
        except (WeightSyncError, RuntimeError) as exc:
            log.debug("NIXL hop rid=%d: deleting %r: %s", self._rid, self._key, exc)
        if self._thread.is_alive():
            log.warning("NIXL hop rid=%d: its thread did not end within timeout_s; leaving its agent", self._rid)
            return
        self._agent.close()

