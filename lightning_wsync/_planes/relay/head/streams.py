"""A sharded push across hosts, send side: every trainer rank relays its own share (a *stream*).

::

    rank 0 (host A) ──share 0──► leader of host X ──► leader of host Y ──► ...
    rank 1 (host B) ──share 1──► leader of host X ──► leader of host Y ──► ...

Each trainer rank heads a relay chain of its own (:class:`~lightning_wsync._planes.relay.head.feed.RelayHead`
over its share's ring) under the stream number :func:`~lightning_wsync._control.keys.relay_stream`
in place of the epoch: its own elections, chain, hops and trailer MACs, so a share can never
pass for another rank's. A rollout host receives each stream once, into a host ring per
stream, and its receivers assemble whole versions from them
(:mod:`~lightning_wsync._planes.relay.sharded`). A trainer host sends only its ranks' shares.

Membership stays on rank 0: at each refresh :class:`ShardStreamsPlane` works out every
stream's live leaders (the hosts other than that rank's own) and writes them to
``relay/<stream>/leaders`` for the other ranks, whose :class:`StreamHead` reads them every
``CHAIN_POLL_S`` and re-forms its chain from them. Each stream takes the shape the unsharded relay
would (the sender's ``cross_host``: a chain, two trees, or the push-time model's pick per stream); with
``delta`` on, each rank encodes its own share's deltas against the version each next leader holds.

With ``transport='nixl'`` (``nixl``) nobody sends: each rank lends its share's ring over NIXL
(:func:`~lightning_wsync._planes.nixl.open.lend_share`, the record ``nixl/<stream>/agent/sender``) and
each stream's leaders READ it hop by hop (:mod:`~lightning_wsync._planes.nixl.hop`), down a chain or one
tree (:func:`~lightning_wsync._planes.nixl.open.stream_shape`), whole versions only (docs/nixl.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from typing_extensions import override

from lightning_wsync._control import keys
from lightning_wsync._control.records import StreamLeadersRecord
from lightning_wsync._control.shards import ShardPlan
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import Timing
from lightning_wsync._control.untrusted import unexpected
from lightning_wsync._planes.base import Peer
from lightning_wsync._planes.delta.encode import AutoPolicy, DeltaStreams
from lightning_wsync._planes.nixl.open import lend_share, stream_shape
from lightning_wsync._planes.nixl.send import NixlSendPlane
from lightning_wsync._planes.relay.alone import alone_leaders
from lightning_wsync._planes.relay.head.feed import RelayHead
from lightning_wsync._planes.relay.head.plane import RelaySendPlane, live_leaders
from lightning_wsync._planes.relay.hops import CHAIN_POLL_S, Stream, error_text
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)


class ShardStreamsPlane(RelaySendPlane):
    """Trainer rank 0's relay plane of a sharded push: it heads stream 0 (as the unsharded relay heads
    the epoch's chain) and names every other stream's live leaders for its rank."""

    def __init__(
        self, ctl: Control, ring: SnapshotRing, plan: ShardPlan, *, epoch: int, host: str, backend: str, addr: str,
        timing: Timing, deltas: DeltaStreams | None, policy: AutoPolicy, topology: str = "relay", nixl: bool = False,
        job: str = "",
    ) -> None:  # fmt: skip
        """``topology``: the sender's ``cross_host`` (relay | chain | tree), every stream's shape as the
        unsharded relay's would be; ``nixl``: the hops are NIXL READs (rank 0's ring is lent here)."""
        self._hosts = plan.rank_hosts(host)
        self._streams = [keys.relay_stream(epoch, rank) for rank in range(plan.world)]
        self._written: dict[int, dict[int, str]] = {}  # stream -> the leaders last written for it
        self._owner: NixlSendPlane | None = None
        if nixl:  # first: a sender that cannot use NIXL refuses to start, naming why
            self._owner = lend_share(ctl, ring, stream=self._streams[0], job=job, who="WeightSender")
            topology = stream_shape(topology)
        stream = Stream(number=self._streams[0], backend=backend, addr=addr, timeout_s=timing.timeout_s, nixl=nixl)
        try:
            super().__init__(ctl, ring, stream, host=self._hosts[0], timing=timing, deltas=deltas, policy=policy,
                             topology=topology, previous_epoch=epoch - 1 or None)  # fmt: skip
        except BaseException:
            if self._owner is not None:
                self._owner.close(time.monotonic() + 5.0)
            raise

    @override
    def sync(self, live: Sequence[Peer], gone: Sequence[Peer], retired: Sequence[Peer]) -> None:
        super().sync(live, gone, retired)
        if self._owner is not None:  # pins of receivers that left are dropped at once
            self._owner.sync(live, gone, retired)
        for stream, host in zip(self._streams[1:], self._hosts[1:]):
            leaders = self._leaders(stream, live, host)
            if leaders != self._written.get(stream):
                self._ctl.put(keys.relay_stream_leaders(stream), StreamLeadersRecord(leaders))
                self._written[stream] = leaders

    @override
    def _leaders(self, epoch: int, live: Sequence[Peer], own_host: str) -> dict[int, str]:
        """Also the receivers that stand alone in the stream (:mod:`~lightning_wsync._planes.relay.alone`)."""
        return {**live_leaders(self._ctl, epoch, live, own_host), **alone_leaders(self._ctl, epoch, live)}

    @override
    def stop(self) -> None:
        if self._owner is not None:
            self._owner.stop()

    @override
    def close(self, deadline: float) -> list[str]:
        stuck = super().close(deadline)
        if self._owner is not None:
            stuck += self._owner.close(deadline)
        try:
            for stream in self._written:
                self._ctl.delete(keys.relay_stream_leaders(stream))
            for stream in self._streams:
                self._ctl.delete(keys.relay_stream_alone(stream))
        except WeightSyncError as exc:  # the store went first: nothing left to keep bounded
            log.debug("relay streams: leaders keys left on the store: %s", exc)
        return stuck


class StreamHead:
    """A trainer rank's (other than 0) relay of its share: a chain (or trees) headed here, its leaders named by
    rank 0."""

    def __init__(
        self, ctl: Control, ring: SnapshotRing, *, stream: int, written_key: str, backend: str, addr: str,
        timing: Timing, delta: str = "off", topology: str = "relay", nixl: bool = False, job: str = "",
    ) -> None:  # fmt: skip
        """``written_key``: where the newest version written into ``ring`` is noted for rank 0's push reports;
        ``delta``: the sender's setting, applied to this stream (this rank encodes its own share);
        ``topology``: the sender's ``cross_host`` (relay | chain | tree), as for stream 0; ``nixl``: the
        sender's ``transport='nixl'``: ``ring`` is lent over NIXL, READ whole by the stream's leaders."""
        self.ctl = ctl
        self._stream = stream
        self._written_key = written_key
        self._written: int | None = None  # the newest version written, as noted by :meth:`wrote`
        self._noted: int | None = None  # as last set on the store
        self._owner = lend_share(ctl, ring, stream=stream, job=job, who="WeightSyncCallback") if nixl else None
        if nixl:
            delta, topology = "off", stream_shape(topology)  # whole versions, READ hop by hop
        self._deltas = DeltaStreams(ring.layout) if delta != "off" else None
        hops = Stream(number=stream, backend=backend, addr=addr, timeout_s=timing.timeout_s, nixl=nixl)
        self._head = RelayHead(ctl, ring, hops, timing=timing, deltas=self._deltas, policy=AutoPolicy(delta),
                               topology=topology)  # fmt: skip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"wsync-relay-stream-{stream}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ctl = self.ctl.clone()
        key = keys.relay_stream_leaders(self._stream)
        while not self._stop.is_set():
            try:
                if (written := self._written) is not None and written != self._noted:
                    ctl.set_text(self._written_key, str(written))
                    self._noted = written
                record = ctl.get_record(key, StreamLeadersRecord)
                self._head.update_chain({} if record is None else record.leaders)
            except WeightSyncError as exc:  # an unreadable record or a lost store: the chain stays as it is
                log.debug("relay stream %d: %s", self._stream, error_text(exc))
            except Exception as exc:  # noqa: BLE001 - this rank's share would stop being relayed, unsaid
                unexpected(log, self._thread.name, exc)
            self._stop.wait(CHAIN_POLL_S)

    def wrote(self, version: int) -> None:
        """This rank's share of ``version`` is in its ring (noted on the store from this head's thread)."""
        self._written = version

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop relaying; this head's thread, its feed's and its encoders' are waited for within one
        ``timeout_s`` (each part gets what the parts before it left)."""
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        self._head.close(timeout_s=max(0.0, deadline - time.monotonic()))
        if self._owner is not None:
            for name in self._owner.close(deadline):
                log.warning("relay stream %d: thread %s did not end within timeout_s=%s", self._stream, name,
                            timeout_s)  # fmt: skip
        if self._deltas is not None:
            self._deltas.close(timeout_s=max(0.0, deadline - time.monotonic()))
        try:
            self.ctl.delete(self._written_key)
        except WeightSyncError as exc:  # the store went first: nothing left to keep bounded
            log.debug("relay stream %d: %s", self._stream, error_text(exc))


def relays_streams(transport: str, cross_host: str) -> bool:
    """A sharded sender with these settings relays each rank's share to other hosts (a stream per rank):
    over gloo hops (``transport='auto'``) or NIXL READs (``'nixl'``)."""
    return transport in ("auto", "nixl") and cross_host != "star"
