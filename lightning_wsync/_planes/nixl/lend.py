"""A relay leader's host ring lent to the next leader over NIXL: its published versions and
the one it is still writing (the other side of :mod:`.hop`; docs/nixl.md).

The owner's pins are leases: on the draft's slot while it is written (the leader's own
write: nothing else claims it), then a :class:`~lightning_wsync._planes.shm.ring.Lease` on
the published slot, taken before the reader is told the draft was kept; renewed by each
completed chunk READ (its NIXL notification) and dropped after twice ``lease_s`` idle.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field

from lightning_wsync._control import keys
from lightning_wsync._control.records import NixlAgentRecord
from lightning_wsync._control.store import Control
from lightning_wsync._planes.nixl import messages
from lightning_wsync._planes.nixl.agent import Agent, NixlError, Refusals
from lightning_wsync._planes.shm.ring import Lease, SnapshotRing
from lightning_wsync._planes.shm.segment import ShmSegment, SlotRef
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)

_POLL_S = 0.001  # while a reader holds a pin
_IDLE_POLL_S = 0.005


def owner_key(stream: int, rid: int) -> str:
    """Where leader ``rid``'s :class:`HopOwner` publishes its agent record."""
    return keys.nixl_agent(stream, f"leader{rid}")


@dataclass
class _Writing:
    """The version a leader is READing into a draft slot, as it is lent downstream."""

    version: int
    slot: int
    seq: int  # the draft's (odd) sequence
    origin_seq: int
    trailer: list[int]
    landed: int = 0


@dataclass
class _Pin:
    lease: Lease | None  # None while the pinned version is a draft
    draft: _Writing | None
    progress_ns: int = field(default_factory=time.monotonic_ns)


class HopOwner:
    """A leader's host ring lent to the next leader: its published versions and the one being written."""

    def __init__(self, ctl: Control, ring: SnapshotRing, segment: ShmSegment, *, stream: int, rid: int) -> None:
        self._ctl = ctl
        self._ring = ring
        self._stream = stream
        self._agent = Agent(f"wsync-l{rid}-{os.getpid()}-{secrets.token_hex(4)}")
        self._key = owner_key(stream, rid)
        try:
            self._agent.register([segment.header, *segment.data])
            regions = [(segment.header.data_ptr(), segment.header.numel() * 8)]
            regions += [(d.data_ptr(), d.numel()) for d in segment.data]
            ctl.put(self._key, self._agent.record(regions))
        except BaseException:
            self._agent.close()
            raise
        self._lock = threading.Lock()
        self._writing: _Writing | None = None
        self._published: dict[tuple[int, int], tuple[int, list[int]]] = {}  # (slot, seq) -> origin seq, trailer
        self._pins: dict[tuple[str, int], _Pin] = {}
        self._known: set[str] = set()
        self._refused = Refusals()  # reader agents whose record did not load: asked again when they pin
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"wsync-nixl-hop-owner-{rid}", daemon=True)
        self._thread.start()

    # -- the leader's side (its ChainHop's thread) --------------------------------------
    def begin(self, version: int, slot: int, seq: int, origin_seq: int, trailer: list[int]) -> None:
        with self._lock:
            self._writing = _Writing(version, slot, seq, origin_seq, trailer)

    def landed(self, nbytes: int) -> None:
        with self._lock:
            w = self._writing
            if w is None:
                return
            w.landed = nbytes
            tags = [k for k, p in self._pins.items() if p.draft is w]
        for peer, tag in tags:
            self._say(peer, messages.landed(tag, nbytes))

    def end(self, ref: SlotRef | None) -> None:
        """The draft was published as ``ref`` (its pins now hold the published slot), or dropped (None)."""
        with self._lock:
            w, self._writing = self._writing, None
            told = []
            for key, pin in list(self._pins.items()):
                if w is None or pin.draft is not w:
                    continue
                lease = None if ref is None else self._ring.acquire(ref)
                if lease is None:
                    del self._pins[key]
                else:
                    pin.lease, pin.draft = lease, None
                told.append(key)
            if ref is not None and w is not None:
                self._published = {k: v for k, v in self._published.items() if k[0] != ref.slot}
                self._published[(ref.slot, ref.seq)] = (w.origin_seq, w.trailer)
        for peer, tag in told:
            self._say(peer, messages.kept(tag) if ref is not None else messages.dropped(tag))

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        with self._lock:
            for pin in self._pins.values():
                if pin.lease is not None:
                    pin.lease.release()
            self._pins.clear()
        try:
            self._ctl.delete(self._key)
        except (WeightSyncError, RuntimeError) as exc:
            log.debug("NIXL hop owner: deleting %r: %s", self._key, exc)
        if not self._thread.is_alive():
            self._agent.close()

    # -- the owner's thread ---------------------------------------------------------------
    def _say(self, peer: str, message: bytes) -> None:
        try:
            with self._agent.lock:
                self._agent.notify(peer, message)
        except NixlError as exc:
            log.debug("NIXL hop owner: %s", exc)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                with self._agent.lock:
                    inbox = self._agent.messages()
            except NixlError as exc:
                log.warning("NIXL hop owner: %s", exc)
                inbox = {}
            for peer, notes in inbox.items():
                for note in notes:
                    self._handle(peer, note)
            self._expire()
            self._stop.wait(_POLL_S if inbox or self._pins else _IDLE_POLL_S)

    def _handle(self, peer: str, note: bytes) -> None:
        parsed = messages.parse(note)
        if parsed is None:
            return
        kind, numbers = parsed
        tag = numbers[0]
        with self._lock:
            pin = self._pins.get((peer, tag))
            if kind == "T" and pin is not None:
                pin.progress_ns = time.monotonic_ns()
                if pin.lease is not None:
                    pin.lease.touch()
            elif kind == "U" and pin is not None:
                if pin.lease is not None:
                    pin.lease.release()
                del self._pins[(peer, tag)]
        if kind == "P" and len(numbers) == 2 and self._load(peer):
            self._pin(peer, tag, None if numbers[1] < 0 else numbers[1])

    def _load(self, peer: str) -> bool:
        """Whether ``peer`` is the next leader's hop reader, its metadata loaded (so it can be answered)."""
        if peer in self._known:
            return True
        if self._refused.resting(peer):
            return False
        parts = peer.split("-")
        if len(parts) != 4 or parts[0] != "wsync" or not parts[1].startswith("h") or not parts[1][1:].isdigit():
            return False
        try:
            record = self._ctl.get_record(keys.nixl_agent(self._stream, parts[1]), NixlAgentRecord)
            if record is None or record.name != peer:
                return False
            with self._agent.lock:
                self._agent.add_remote(record)
        except (WeightSyncError, NixlError) as exc:
            log.log(self._refused.refuse(peer, str(exc)), "NIXL hop owner: ignoring agent %r: %s", peer, exc)
            return False
        self._refused.accepted(peer)
        self._known.add(peer)
        return True

    def _pin(self, peer: str, tag: int, after: int | None) -> None:
        answer = messages.nothing(tag)
        with self._lock:
            old = self._pins.pop((peer, tag), None)
            if old is not None and old.lease is not None:
                old.lease.release()
            w = self._writing
            if w is not None and (after is None or w.version > after):
                self._pins[(peer, tag)] = _Pin(None, w)
                answer = messages.hop_grant(messages.HopGrant(tag, w.version, w.slot, w.seq, w.origin_seq, 1,
                                                              w.landed, w.trailer))  # fmt: skip
            else:
                lease = self._ring.acquire_newer(after, 0.0)
                known = None if lease is None else self._published.get((lease.ref.slot, lease.ref.seq))
                if lease is not None and known is None:
                    lease.release()
                elif lease is not None and known is not None:
                    ref = lease.ref
                    self._pins[(peer, tag)] = _Pin(lease, None)
                    answer = messages.hop_grant(messages.HopGrant(tag, ref.version, ref.slot, ref.seq, known[0], 0,
                                                                  self._ring.layout.total_bytes, known[1]))  # fmt: skip
        self._say(peer, answer)

    def _expire(self) -> None:
        """Drop pins idle for twice the lease (the ring stopped honouring them after one)."""
        idle_ns = 2 * self._ring.lease_s * 1e9
        now = time.monotonic_ns()
        with self._lock:
            for key, pin in list(self._pins.items()):
                if now - pin.progress_ns > idle_ns:
                    if pin.lease is not None:
                        pin.lease.release()
                    del self._pins[key]
