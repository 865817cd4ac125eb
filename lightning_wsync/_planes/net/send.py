"""The network plane's send side: one link (a standalone process group) per receiver
that asked for one, made, replaced and pruned as receivers come and go.

A receiver asks for a link by bumping ``member/<rid>/net`` (its link number); the
plane then builds a :class:`~lightning_wsync._planes.net.sendlink.NetSendLink` under that
number. A link whose receiver is gone is stopped and dropped at once (its process group
with it: an aborted gloo group holds threads and file descriptors), and a retired
receiver's process-group keys are deleted from the store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from lightning_wsync._control import keys
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import Timing
from lightning_wsync._planes.base import Delivery, Peer
from lightning_wsync._planes.delta.encode import AutoPolicy, DeltaStreams
from lightning_wsync._planes.net.sendlink import NetSendLink
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync.errors import WeightSyncRecordError

log = logging.getLogger(__name__)



class NetSendPlane:
    """Links to receivers on other hosts (or every receiver, with ``transport='gloo'``)."""

    def __init__(
        self, control: Control, ring: SnapshotRing, *, epoch: int, backend: str, addr: str, timing: Timing,
        deltas: DeltaStreams | None, policy: AutoPolicy,
    ) -> None:  # fmt: skip
        self._ctl = control
        self._ring = ring
        self._epoch = epoch
        self._backend = backend
        self._addr = addr
        self._timeout_s = timing.timeout_s
        self._follow_all_s = timing.follow_all_s  # links/asked says when else
        self._deltas = deltas
        self._policy = policy
        self._links: dict[int, NetSendLink] = {}
        self._cleaned: dict[int, int] = {}  # rid -> process-group keys deleted up to this link number
        self._lock = threading.Lock()
        self._superseded = 0  # by links already dropped
        self._stopping: list[NetSendLink] = []  # dropped links still ending (joined on close)
        self._followed: tuple[str | None, frozenset[int]] | None = None  # links/asked and live rids last followed
        self._follow_all_at = 0.0

    def sync(self, live: Sequence[Peer], gone: Sequence[Peer], retired: Sequence[Peer]) -> None:
        # Every live receiver's link number is read when one asked for a link (links/asked
        # moved), when the receivers changed, and every timing.follow_all_s: not at every call.
        asked = self._ctl.get_text(keys.LINKS_ASKED)
        rids = frozenset(p.rid for p in live)
        now = time.monotonic()
        if (asked, rids) == self._followed and not gone and not retired and now < self._follow_all_at:
            self._reap()
            return
        self._followed, self._follow_all_at = (asked, rids), now + self._follow_all_s
        garbled: list[WeightSyncRecordError] = []  # one receiver's counter never stops the others' links
        for peer in gone:
            self._drop(peer.rid)
        for peer in retired:
            self._drop(peer.rid)
            try:
                self._delete_groups(peer.rid, self._ctl.add(keys.member_link(peer.rid), 0))
            except WeightSyncRecordError as exc:
                garbled.append(exc)
            self._ctl.delete(keys.member_link(peer.rid))
            self._cleaned.pop(peer.rid, None)
        for peer in live:
            try:
                self._follow(peer.rid)
            except WeightSyncRecordError as exc:
                garbled.append(exc)
        self._reap()
        if garbled:
            self._followed = None  # looked at again next time, the counter maybe rewritten by its receiver
            raise garbled[0]  # the sender's thread says it once (a bad record)

    def _follow(self, rid: int) -> None:
        """Make the link ``rid`` asked for; once both ends used it, its group's keys are spent."""
        number = self._ctl.add(keys.member_link(rid), 0)
        link = self._links.get(rid)
        if link is not None and link.sent_version is not None and link.number > self._cleaned.get(rid, 0):
            self._delete_groups(rid, link.number)
        if number == 0 or (link is not None and link.number >= number):
            return
        self._drop(rid)
        if self._deltas is not None:
            self._deltas.prepare()
        with self._lock:
            self._links[rid] = NetSendLink(
                self._ctl, self._ring, epoch=self._epoch, rid=rid, number=number, backend=self._backend,
                addr=self._addr, timeout_s=self._timeout_s, deltas=self._deltas, policy=self._policy,
            )  # fmt: skip

    def _drop(self, rid: int) -> None:
        with self._lock:
            link = self._links.pop(rid, None)
        if link is not None:
            link.stop()
            self._superseded += link.superseded
            self._stopping.append(link)

    def _reap(self) -> None:
        """Forget dropped links whose thread has ended, so their process groups can be freed."""
        self._stopping = [link for link in self._stopping if not link.join(0)]

    def _delete_groups(self, rid: int, up_to: int) -> None:
        for number in range(self._cleaned.get(rid, 0) + 1, up_to + 1):
            for key in keys.group_keys(keys.link_prefix(self._epoch, rid, number)):
                self._ctl.delete(key)
        self._cleaned[rid] = max(self._cleaned.get(rid, 0), up_to)

    def published(self, version: int, live: Sequence[Peer]) -> None:
        pass  # every link's thread waits on the ring for the next version itself

    def deliveries(self, version: int, peers: Sequence[Peer]) -> dict[str, Delivery]:
        with self._lock:
            links = dict(self._links)
        out: dict[str, Delivery] = {}
        for peer in peers:
            link = links.get(peer.rid)
            if link is not None and version in link.delta_versions:
                out[peer.name] = Delivery(True, link.delta_versions[version], own=True)
        return out

    def failure(self, rid: int, version: int) -> str | None:
        link = self._links.get(rid)
        if link is not None and link.error is not None:
            return f"network link failed: {link.error}"
        return None

    @property
    def superseded(self) -> int:
        with self._lock:
            links = list(self._links.values())
        return self._superseded + sum(link.superseded for link in links)

    def links(self) -> int:
        """Links held now (dropped ones still ending included)."""
        return len(self._links) + len(self._stopping)

    def stop(self) -> None:
        with self._lock:
            links = list(self._links.values())
        for link in links + self._stopping:
            link.stop()

    def close(self, deadline: float) -> list[str]:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        links += self._stopping
        self._stopping = []
        return [f"link to rid={link.rid}" for link in links if not link.join(deadline - time.monotonic())]
