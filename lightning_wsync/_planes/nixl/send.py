"""The NIXL plane's send side: the ring's owner lends slots to remote readers.

The owner registers its shared-memory ring (header page and slots) with a NIXL agent and
publishes the agent's metadata and those regions as a signed record. It never sends a
byte itself: a remote reader asks for a pin (a notification), the owner leases the newest
slot above what the reader has (an in-process :class:`~lightning_wsync._planes.shm.ring.Lease`,
so the ring will not rewrite it) and answers with the version's signed trailer; the
reader READs the slot, each completed chunk READ notifying the owner (the lease's
progress), then unpins. A reader that stops making progress for the ring's ``lease_s``
loses the slot, as a same-host reader does (docs/nixl.md).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence

import torch

from lightning_wsync._control import keys
from lightning_wsync._control.records import DeviceRegion, NixlAgentRecord
from lightning_wsync._control.store import Control
from lightning_wsync._planes.base import Delivery, Peer
from lightning_wsync._planes.nixl import messages
from lightning_wsync._planes.nixl.agent import Agent, NixlError, Refusals
from lightning_wsync._planes.shm.ring import Lease, SnapshotRing
from lightning_wsync._planes.shm.segment import ShmSegment
from lightning_wsync._planes.wire import signed_trailer
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)

_POLL_S = 0.001  # while a reader holds a pin
_IDLE_POLL_S = 0.005  # otherwise: a pin request waits this long at most
_READER = re.compile(r"^wsync-([rh])(\d+)-\d+-[0-9a-f]+$")  # r: a receiver; h: a relay leader's hop (hop.py)


def reader_name(rid: int, pid: int, token: str) -> str:
    return f"wsync-r{rid}-{pid}-{token}"


class NixlSendPlane:
    """Lends the ring's slots to receivers on other hosts that READ them through NIXL.

    ``mirror``: the ring's GPU mirror (``cuda_ipc=True``), registered too (``VRAM``) and
    listed in the record, so a reader whose module is on a GPU READs device to device. A
    mirror slot holds the same version as its host slot under the same sequence word and
    pins, so one grant serves either. NIXL refusing it leaves host memory only, said once.
    """

    def __init__(self, ctl: Control, ring: SnapshotRing, segment: ShmSegment, *, epoch: int, name: str,
                 mirror: Sequence[torch.Tensor] = ()) -> None:  # fmt: skip
        self._ctl = ctl
        self._ring = ring
        self._epoch = epoch
        self._agent = Agent(name)
        self._mirror = list(mirror)  # held until the agent deregisters it (the ring may close first)
        try:
            self._agent.register([segment.header, *segment.data])
            regions = [(segment.header.data_ptr(), segment.header.numel() * 8)]
            regions += [(d.data_ptr(), d.numel()) for d in segment.data]
            self._key = keys.nixl_agent(epoch, "sender")
            ctl.put(self._key, self._agent.record(regions, self._register_mirror()))
        except BaseException:
            self._agent.close()
            raise
        self._leases: dict[tuple[str, int], Lease] = {}  # (reader agent, tag) -> its pin
        self._readers: dict[str, int] = {}  # reader agent -> rid
        self._relayed: set[str] = set()  # reader agents of relay hops: trailers signed for RELAY_RID, forwarded
        self._refused = Refusals()  # agents whose record did not load: ignored until it is replaced
        self._delivered: dict[int, int] = {}  # rid -> newest version it unpinned
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"wsync-nixl-owner-{epoch}", daemon=True)
        self._thread.start()

    def _register_mirror(self) -> list[DeviceRegion]:
        if not self._mirror:
            return []
        try:
            self._agent.register(self._mirror)
        except NixlError as exc:
            log.warning("NIXL owner of epoch %d: the ring's GPU mirror is not lent (%s); readers READ host "
                        "memory", self._epoch, exc)  # fmt: skip
            self._mirror = []
            return []
        log.info("NIXL owner of epoch %d: lending the ring's GPU mirror on %s too", self._epoch, self._mirror[0].device)
        return [DeviceRegion(t.data_ptr(), t.numel(), t.get_device()) for t in self._mirror]

    # -- SendPlane --------------------------------------------------------------------
    def sync(self, live: Sequence[Peer], gone: Sequence[Peer], retired: Sequence[Peer]) -> None:
        dead = {p.rid for p in gone} | {p.rid for p in retired}
        if not dead:
            return
        with self._lock:
            for key, lease in list(self._leases.items()):
                if self._readers.get(key[0]) in dead:
                    lease.release()
                    del self._leases[key]

    def published(self, version: int, live: Sequence[Peer]) -> None:
        pass  # readers learn of versions from the store and ask for them

    def deliveries(self, version: int, peers: Sequence[Peer]) -> dict[str, Delivery]:
        with self._lock:
            got = dict(self._delivered)
        return {p.name: Delivery(False, None, True) for p in peers if got.get(p.rid) == version}

    def failure(self, rid: int, version: int) -> str | None:
        return None

    @property
    def superseded(self) -> int:
        return 0  # a slot rewritten under a stalled reader is the reader's to notice (its header re-read)

    def stop(self) -> None:
        self._stop.set()

    def close(self, deadline: float) -> list[str]:
        self._stop.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            return [self._thread.name]
        with self._lock:
            for lease in self._leases.values():
                lease.release()
            self._leases.clear()
        try:
            self._ctl.delete(self._key)
        except (WeightSyncError, RuntimeError) as exc:
            log.debug("NIXL owner: deleting %r: %s", self._key, exc)
        self._agent.close()
        self._mirror = []  # deregistered: the ring's GPU memory may go
        return []

    # -- the owner's thread -----------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                inbox = self._agent.messages()
            except NixlError as exc:
                log.warning("NIXL owner of epoch %d: %s", self._epoch, exc)
                inbox = {}
            for peer, notes in inbox.items():
                for note in notes:
                    self._handle(peer, note)
            self._expire()
            with self._lock:
                busy = bool(self._leases)
            self._stop.wait(_POLL_S if busy or inbox else _IDLE_POLL_S)

    def _handle(self, peer: str, note: bytes) -> None:
        parsed = messages.parse(note)
        if parsed is None:
            return
        kind, numbers = parsed
        tag = numbers[0]
        with self._lock:
            lease = self._leases.get((peer, tag))
            if kind == "T" and lease is not None:
                lease.touch()
            elif kind == "U" and lease is not None:
                lease.release()
                del self._leases[(peer, tag)]
                rid = self._readers.get(peer)
                if rid is not None:
                    self._delivered[rid] = lease.ref.version
        if kind == "P" and len(numbers) == 2:
            self._pin(peer, tag, None if numbers[1] < 0 else numbers[1])

    def _pin(self, peer: str, tag: int, after: int | None) -> None:
        rid = self._reader(peer)
        if rid is None:
            return
        lease = self._ring.acquire_newer(after, 0.0)
        answer = messages.nothing(tag)
        if lease is not None:
            sums = self._ring.checksums(lease)
            if sums is None:
                lease.release()
            else:
                ref = lease.ref
                signer = messages.RELAY_RID if peer in self._relayed else rid
                trailer = signed_trailer(self._ctl, self._epoch, signer, ref.version, ref.seq, sums, intact=True,
                                         buckets=len(sums)).tolist()  # fmt: skip
                with self._lock:
                    old = self._leases.pop((peer, tag), None)
                    if old is not None:
                        old.release()
                    self._leases[(peer, tag)] = lease
                answer = messages.grant(messages.Grant(tag, ref.version, ref.slot, ref.seq, trailer))
        try:
            self._agent.notify(peer, answer)
        except NixlError as exc:
            log.debug("NIXL owner: %s", exc)

    def _reader(self, peer: str) -> int | None:
        """The rid of a reader agent, its metadata loaded (so it can be answered); None: ignore it."""
        rid = self._readers.get(peer)
        if rid is not None:
            return rid
        if self._refused.resting(peer):
            return None
        match = _READER.match(peer)
        if match is None:
            self._refuse(peer, "not a wsync reader's agent name")
            return None
        kind, rid = match.group(1), int(match.group(2))
        try:
            record = self._ctl.get_record(keys.nixl_agent(self._epoch, f"{kind}{rid}"), NixlAgentRecord)
            if record is None or record.name != peer:
                return None  # not published yet (or replaced): it asks again
            self._agent.add_remote(record)
        except (WeightSyncError, NixlError) as exc:
            self._refuse(peer, str(exc))
            return None
        self._refused.accepted(peer)
        with self._lock:
            self._readers[peer] = rid
            if kind == "h":
                self._relayed.add(peer)
        return rid

    def _refuse(self, peer: str, why: str) -> None:
        level = self._refused.refuse(peer, why)
        log.log(level, "NIXL owner of epoch %d: ignoring agent %r: %s", self._epoch, peer, why)

    def _expire(self) -> None:
        """Drop pins idle for twice the lease (the ring stopped honouring them after one)."""
        idle_ns = 2 * self._ring.lease_s * 1e9
        now = time.monotonic_ns()
        with self._lock:
            for key, lease in list(self._leases.items()):
                if now - lease.progress_ns > idle_ns:
                    lease.release()
                    del self._leases[key]
