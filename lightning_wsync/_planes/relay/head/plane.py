"""The relay plane's send side: the chain of host leaders, fed by :class:`RelayHead`.

At each membership refresh the chain is re-formed from the live receivers that lead a
host other than the sender's (each host elects its leader on the store:
:mod:`~lightning_wsync._planes.relay.leader.member`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from lightning_wsync._control import keys
from lightning_wsync._control.records import SenderRecord
from lightning_wsync._control.retire import retire_relay_keys
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import Timing
from lightning_wsync._planes.base import Delivery, Peer
from lightning_wsync._planes.delta.encode import AutoPolicy, DeltaStreams
from lightning_wsync._planes.relay.head.feed import RelayHead, leader_record
from lightning_wsync._planes.relay.hops import Stream, read_chain, ring_bell
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync.errors import WeightSyncAuthError, WeightSyncRecordError

log = logging.getLogger(__name__)



class RelaySendPlane:
    """One copy of each version into each other host, relayed leader to leader."""

    def __init__(
        self, control: Control, ring: SnapshotRing, stream: Stream, *, host: str, timing: Timing,
        deltas: DeltaStreams | None, policy: AutoPolicy, topology: str = "relay", previous_epoch: int | None = None,
    ) -> None:  # fmt: skip
        """``previous_epoch``: the sender epoch before this one, whose chain's leaders are rung at the
        first :meth:`sync` (their watchers then read ``news`` and follow this sender at once)."""
        self._ctl = control
        self._report_ctl = control.clone()  # push reports read receipts from the callers' threads
        self._report_lock = threading.Lock()
        self._epoch = stream.number
        self._host = host
        self._delta = deltas is not None
        self._moved: str | None = None  # relay/<epoch>/moved as last read through
        self._live: set[int] = set()
        self._next_all = 0.0
        self._follow_all_s = timing.follow_all_s
        self._previous = previous_epoch  # its chain's leaders are rung once, after this epoch's news
        # ... and its relay keys deleted once none of its leaders can still touch them (it was killed,
        # or they are the few a leader stopped meanwhile wrote back): retire_previous_at (time.monotonic()).
        self._retire: tuple[int, float] | None = None
        if previous_epoch is not None:
            self._retire = (previous_epoch, time.monotonic() + _linger_of(control, previous_epoch, timing))
        self._head = RelayHead(control, ring, stream, timing=timing, deltas=deltas, policy=policy, topology=topology)

    def sync(self, live: Sequence[Peer], gone: Sequence[Peer], retired: Sequence[Peer]) -> None:
        # The leader records and broken keys (a request per host each) are read when
        # relay/<epoch>/moved moved, when the live receivers changed, and every timing.follow_all_s: every
        # writer of them bumps moved, and a dead leader leaves the live receivers, so that is for a lost bump.
        if (previous := self._previous) is not None:
            self._previous = None
            wake_chain(self._ctl, previous)
        if (retire := self._retire) is not None and time.monotonic() >= retire[1]:
            self._retire = None
            swept = retire_relay_keys(self._ctl, below=retire[0] + 1)
            log.debug("relay: %d keys of sender epoch %d and before deleted", swept, retire[0])
        by_rid = {p.rid: p for p in live}
        moved, now = self._ctl.get_text(keys.relay_moved(self._epoch)), time.monotonic()
        if moved is not None and moved == self._moved and set(by_rid) == self._live and now < self._next_all:
            self._head.update_chain(self._head.leaders, look=False)
            return
        self._head.update_chain(self._leaders(self._epoch, live, self._host))
        self._moved, self._live, self._next_all = moved, set(by_rid), now + self._follow_all_s

    def _leaders(self, epoch: int, live: Sequence[Peer], own_host: str) -> dict[int, str]:
        """rid -> host of the leaders of relay ``epoch`` (or stream) among ``live``, away from ``own_host``."""
        return live_leaders(self._ctl, epoch, live, own_host)

    def published(self, version: int, live: Sequence[Peer]) -> None:
        pass  # the head's thread waits on the ring for the next version itself

    def deliveries(self, version: int, peers: Sequence[Peer]) -> dict[str, Delivery]:
        """A receiver on a relay host got ``version`` the way its host's leader did."""
        if not self._delta:
            return {}
        with self._report_lock:
            receipts = self._head.receipts(self._report_ctl, version)
        return {
            p.name: Delivery(True, receipts[p.host].decode_s, own=False)
            for p in peers
            if p.host in receipts and receipts[p.host].delta
        }

    def failure(self, rid: int, version: int) -> str | None:
        return None  # a failed hop is bypassed; the receivers behind it report through their state

    @property
    def superseded(self) -> int:
        return 0

    def stop(self) -> None:
        pass  # close() stops the head and joins it against the deadline

    def close(self, deadline: float) -> list[str]:
        self._head.close(timeout_s=max(0.0, deadline - time.monotonic()))
        return []


def _linger_of(ctl: Control, epoch: int, timing: Timing) -> float:
    """How long after this sender's start sender ``epoch``'s leaders may still touch its relay keys: its
    hop timeout plus heartbeat timeout (a leader follows the new sender within a beat period of its
    bell, and a hop it was in ends by then), this sender's own where its record is unreadable."""
    try:
        record = ctl.get_record(keys.sender_record(epoch), SenderRecord)
    except (WeightSyncRecordError, WeightSyncAuthError) as exc:
        log.debug("relay: sender record of epoch %d: %s", epoch, exc)
        record = None
    if record is None:
        return timing.relay_linger_s
    return max(timing.relay_linger_s, record.timeout_s + record.heartbeat_timeout_s)


def wake_chain(ctl: Control, epoch: int) -> None:
    """Ring the bell of every leader in sender epoch ``epoch``'s chain, if it left one (a sender
    that closed rang them itself and deleted it; one that was killed did neither)."""
    try:
        chain = read_chain(ctl, epoch)
    except (WeightSyncRecordError, WeightSyncAuthError) as exc:  # not ours to judge: its bells go unrung
        log.debug("relay: chain of epoch %d: %s", epoch, exc)
        return
    for rid in () if chain is None else chain.rids:
        ring_bell(ctl, epoch, rid)


def live_leaders(ctl: Control, epoch: int, live: Sequence[Peer], own_host: str) -> dict[int, str]:
    """rid -> host of the live receivers that lead a host other than ``own_host`` (the sending side's)."""
    by_rid = {p.rid for p in live}
    leaders: dict[int, str] = {}
    for host in sorted({p.host for p in live if p.host != own_host}):
        record = leader_record(ctl, epoch, host)
        if record is not None and record.rid in by_rid:
            leaders[record.rid] = host
    return leaders
