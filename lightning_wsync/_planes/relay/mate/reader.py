"""A receiver's data plane on a relay host: the host's ring, fed by its leader, or the
network when this receiver cannot share that ring (see :mod:`~lightning_wsync._planes.relay.leader.member`)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol

import torch
from typing_extensions import override

from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import Timing
from lightning_wsync._planes.base import (
    BoardRead,
    HostLink,
    HostNews,
    HostTurn,
    Posted,
    ReceiveSource,
    Reject,
    SumsLookup,
)
from lightning_wsync._planes.net.source import NetworkSource
from lightning_wsync._planes.relay.mate.board import read_board
from lightning_wsync._planes.relay.mate.news import read_news
from lightning_wsync._planes.shm.files import SHM_DIR, pin_dir
from lightning_wsync._planes.shm.segment import ShmReader
from lightning_wsync._planes.shm.source import SharedMemorySource
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)

_SEGMENT_POLL_S = 0.005  # a waiting host-mate reads the segment header this often (~0.5% of a core)


class Member(Protocol):
    @property
    def leads(self) -> bool: ...

    def post(self, news: HostNews) -> None: ...

    def own_board(self) -> Posted | None:
        """While it leads: its own board (it passes its own notes on with its host-mates')."""
        ...

    def close(self, timeout_s: float = 10.0) -> None: ...


class RingFollower(Protocol):
    """What a relay member points at its host leader's ring (:class:`HostRingReader`, or a stream's ring)."""

    def follow(self, segment: str | None, *, ready: bool = False) -> str | None: ...

    def following(self) -> str | None:
        """The name of the ring read now (None: none is open)."""
        ...

    def board(self) -> Posted | None:
        """The board of the leader whose ring is read now (None: no ring, or no board yet)."""
        ...


def open_leader_ring(segment: str, layout: Manifest, *, ready: bool) -> tuple[ShmReader | None, str | None]:
    """A reader of the leader's ring ``segment``; else None, and why when the leader says it exists
    (``ready``): this process does not share /dev/shm or a user with the leader, and never will."""
    try:
        return ShmReader(segment, layout), None
    except (OSError, ValueError, WeightSyncError) as exc:
        if ready:
            return None, (exc.strerror or str(exc) if isinstance(exc, OSError) else str(exc))
        log.debug("host ring %s not readable yet: %s", segment, exc)  # its leader is creating it
        return None, None


class HostRingReader:
    """The host's ring of verified versions, read as same-host receivers read the trainer's."""

    def __init__(self, epoch: int, layout: Manifest, ordered: list[torch.Tensor], name: str) -> None:
        self.epoch = epoch
        self.layout = layout
        self._ordered = ordered
        self._name = name
        self._source: SharedMemorySource | None = None
        self._segment: str | None = None
        self._lock = threading.Lock()

    def follow(self, segment: str | None, *, ready: bool = False) -> str | None:
        """Read from the ring ``segment`` from now on (the current leader's).

        Returns why it cannot be opened when its leader says it exists (``ready``): this
        process does not share /dev/shm or a user with the leader, and never will.
        """
        with self._lock:
            if segment == self._segment and self._source is not None:
                return None
            if self._source is not None:
                self._source.close()
                self._source = None
            self._segment = segment
            if segment is None:
                return None
            reader, why = open_leader_ring(segment, self.layout, ready=ready)
            if reader is None:
                self._segment = None
                return why
            self._source = SharedMemorySource(self.epoch, self.layout, self._ordered, reader, self._name)
            return None

    def current(self) -> SharedMemorySource | None:
        return self._source

    def following(self) -> str | None:
        """The name of the ring read now (None: none is open)."""
        return self._segment if self._source is not None else None

    def board(self) -> Posted | None:
        """The board of the leader whose ring is read now (:mod:`~lightning_wsync._planes.relay.mate.board`)."""
        segment = self.following()
        return None if segment is None else read_board(pin_dir(os.path.join(SHM_DIR, segment)))

    def apply(self, held: int | None, sums: SumsLookup | None, reject: Reject) -> int | None:
        with self._lock:  # follow() cannot close the ring under a copy
            source = self._source
            return None if source is None else source.apply(held, sums, reject)

    def pending_above(self, held: int | None) -> bool:
        with self._lock:
            return self._source is not None and self._source.pending_above(held)

    def close(self) -> None:
        self.follow(None)


class RelaySource(ReceiveSource):
    """A receiver's data plane on a relay host (a ``ReceiveSource``): the host's ring, fed by its leader.

    With ``verify``, versions from the host ring are checked against the published
    checksums like any shared-memory version (the leader verified the trainer's signed
    trailer; this also catches a ring damaged on the host). A receiver that cannot take
    part in its host's ring (see :meth:`fall_back`) is served over the network instead.
    """

    def __init__(self, epoch: int, segment: HostRingReader, net: Callable[[], NetworkSource]) -> None:
        self.epoch = epoch
        self.segment = segment
        self.member: Member | None = None
        self._net_factory = net
        self._net: NetworkSource | None = None
        self._lock = threading.Lock()
        self._reads_store = False  # at its watcher's last turn: it led, or had no leader's board to read

    def fall_back(self, why: str) -> None:
        """Receive over the network from the sender from now on (``why``: what the host ring lacks)."""
        with self._lock:
            if self._net is None:
                self._net = self._net_factory()

    def apply(self, held: int | None, sums: SumsLookup | None, reject: Reject) -> int | None:
        net = self._net
        if net is not None:
            return net.apply(held, sums, reject)
        return self.segment.apply(held, sums, reject)

    def pending_above(self, held: int | None) -> bool:
        net = self._net
        return net.pending_above(held) if net is not None else self.segment.pending_above(held)

    @override
    def host_link(self) -> HostLink:
        return self

    def leads(self) -> bool:
        """This receiver leads its host's ring (its bell then wakes its watcher: ``on_rung``): its
        member's answer (:attr:`~lightning_wsync._planes.relay.leader.member.RelayMember.leads`),
        while it is served through the host's ring."""
        member = self.member
        return self._net is None and member is not None and member.leads

    def beat_board(self) -> Posted | None:
        """The board of the leader that passes this receiver's beats and acknowledgements on
        (:mod:`~lightning_wsync._planes.relay.mate.notes`): its host leader's, or its own while it
        leads; None when it receives over the network. A host-mate also reads what its leader
        last read from the store for the host off it (its watcher then need not ask the store)."""
        member = self.member
        if self._net is not None or member is None:
            return None
        return member.own_board() if member.leads else self.segment.board()

    def turn(self) -> HostTurn:
        board = self.beat_board()
        leads = self.leads()
        posted = None if leads else board
        self._reads_store = posted is None
        return HostTurn(board, posted, leads)

    def pace(self, timing: Timing, sender_gone: bool) -> float:
        """A leader is kicked by each version it receives and by its bell, else reads ``news`` every
        ``lead_backstop_s`` (every ``relay_poll_s`` once its sender left or closed: the next sender is
        found through news alone); a receiver here served over the network is kicked by each
        version, so it reads ``news`` slowly too. A host-mate reads news off its leader's board."""
        if self.leads():
            return timing.relay_poll_s if sender_gone else timing.lead_backstop_s
        return timing.relay_poll_s if self._reads_store else timing.idle_poll_s

    def share_news(self, news: HostNews) -> None:
        """For the host's leader: tell the host-mates what its watcher read (else nothing)."""
        if self.leads() and (member := self.member) is not None:
            member.post(news)

    def read_news(self, ctl: Control, board: HostNews, news: str | None, latest_raw: str | None) -> BoardRead:
        return read_news(ctl, board, news, latest_raw, self.epoch)

    def wait_change(self, until: float, give_up: Callable[[], bool]) -> bool:
        source = self.segment.current()
        if source is None or self._net is not None:
            return False  # the network link's on_staged callback wakes the receiver's waiters
        source._poll_s = _SEGMENT_POLL_S  # many waiting host-mates: a lighter watch of the ring header
        return source.wait_change(until, lambda: give_up() or self.segment.current() is not source)

    def describe(self) -> str:
        return "relay across hosts (host ring)" if self._net is None else "network (relay host fallback)"

    def close(self) -> None:
        if self.member is not None:
            self.member.close()
        self.segment.close()
        with self._lock:
            if self._net is not None:
                self._net.close()
