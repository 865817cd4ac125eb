"""The data-plane interface: the send and receive sides every plane implements.

A plane is one subpackage of :mod:`lightning_wsync._planes` (``shm``, ``net``, ``relay``)
with a send side (:class:`SendPlane`, fed from the sender's snapshot ring) and a receive
side (:class:`ReceiveSource`, which applies versions into a receiver's tensors);
:mod:`lightning_wsync._planes.open` is the one place that picks them.

What only some receive sides can do is asked of the source, never probed for: its
:meth:`~ReceiveSource.lender` lends slots for zero-copy loads, its
:meth:`~ReceiveSource.exact` applies a chosen version (a fleet's round), its
:meth:`~ReceiveSource.host_link` beats, acknowledges and hears news through a relay host's
leader. Each returns None where the plane cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from lightning_wsync._control.manifest import Manifest
    from lightning_wsync._control.records import VersionRecord
    from lightning_wsync._control.store import Control
    from lightning_wsync._control.timing import Timing

SumsLookup = Callable[[int], "list[int] | None"]  # version -> its published bucket checksums
Reject = Callable[[int, str], None]  # (version, reason)


class SlotRef(NamedTuple):
    """One complete version in one slot: valid while the slot's sequence is still ``seq``."""

    slot: int
    seq: int
    version: int


class Lender(Protocol):
    """A source that lends a version's slot out of shared memory (an engine's zero-copy load)."""

    layout: Manifest

    def lend(
        self, version: int | None, sums: SumsLookup | None, reject: Reject
    ) -> tuple[SlotRef, list[torch.Tensor]] | None:
        """Pin the newest complete slot (or the one holding ``version``) and return it with its
        entries' read-only views, in layout order; None when there is none (or it failed its checksums)."""
        ...

    def give_back(self, ref: SlotRef) -> bool:
        """Unpin a lent slot; True when its bytes stayed intact the whole time."""
        ...

    def touch(self) -> None:
        """Renew the pin of the slot lent now (within the sender's lease)."""
        ...

    def pending_above(self, held: int | None) -> bool: ...


class ExactApply(Protocol):
    """A source that can apply one chosen version, not only the newest (a fleet's round)."""

    def apply_exactly(self, version: int, sums: SumsLookup | None, reject: Reject) -> int | None:
        """Write ``version`` into the module when the source holds it complete; return it (None: it does not)."""
        ...


class HostNews(NamedTuple):
    """What a relay host's leader last read from the store for its host (and posts on its board)."""

    news: str | None  # the ``news`` counter as written (None: absent)
    latest: str | None  # the ``latest`` record as written (sealed; host-mates verify it)
    # As the leader read them at or after that ``news``: the sender pointer (sealed) and whether
    # the sender it follows has closed or left. With them a host-mate that missed a bump or two
    # (pushes faster than it reads the board) still knows they were versions only.
    sender: str | None = None
    closed: bool = False


class Posted(NamedTuple):
    """A relay host's board as a host-mate read it."""

    news: HostNews
    age_s: float  # since the leader last wrote or touched it
    directory: str = ""  # the pin directory it was read from
    # rid -> the sequence number of the host-mate's note the leader last passed on to the store;
    # None: a leader that passes on no notes (an older version)
    mates: dict[int, int] | None = None


class MateNotes(Protocol):
    """A relay host-mate's notes to its leader, who writes its beats and acknowledgements to the store.

    One per receiver, kept across sources (a note left with one leader is taken back before
    the next): :func:`lightning_wsync._planes.open.open_mate_notes`.
    """

    def keeps(self, posted: Posted | None, rid: int, now: float, period_s: float) -> bool:
        """Whether to beat and acknowledge through the leader whose board is ``posted`` now."""
        ...

    def write(self, directory: str, rid: int, beat: int, state: str | None, now: float) -> bool:
        """Leave a note for the leader whose pin directory is ``directory``; False when it could not."""
        ...

    def confirm(self, now: float) -> None:
        """A beat was written to the store by this receiver itself."""
        ...

    def leave(self) -> bool:
        """Beat on the store from now on; whether a note was taken back."""
        ...


class BoardRead(NamedTuple):
    """What a host-mate took off its leader's board (:meth:`HostLink.read_news`)."""

    seen: str | None  # the ``news`` counter as the board shows it
    taken: bool  # what moved was versions of the sender followed, taken in (the records need not be read)
    latest: VersionRecord | None = None  # the board's ``latest`` record (verified here) when it is new


class HostTurn(NamedTuple):
    """One loop of a relay host receiver's watcher, as its link answers it (:meth:`HostLink.turn`)."""

    board: Posted | None  # the leader's board its beats and acknowledgements go through (None: the store)
    posted: Posted | None  # a host-mate's: its leader's board, news read off it (None: it reads the store)
    leads: bool  # it leads its host: it reads the store for its host-mates (kicked by each version and its bell)


class HostLink(Protocol):
    """A receiver on a relay host: it beats, acknowledges and hears news through its host's leader."""

    def turn(self) -> HostTurn:
        """The one question its watcher asks each loop: where it beats, where it reads news, whether it leads."""
        ...

    def pace(self, timing: Timing, sender_gone: bool) -> float:
        """How long its watcher waits for a kick (it wakes for its heartbeats as well), ``sender_gone``:
        the sender followed left or closed."""
        ...

    def share_news(self, news: HostNews) -> None:
        """For the host's leader: tell the host-mates what its watcher read (else nothing)."""
        ...

    def read_news(self, ctl: Control, board: HostNews, news: str | None, latest_raw: str | None) -> BoardRead:
        """For a host-mate: the news off its leader's ``board``, against ``news`` as last read
        through and ``latest_raw``, the ``latest`` record it holds."""
        ...


@dataclass
class DeltaStats:
    """What one version's delta cost: the push report's per-link metrics."""

    changed_share: float = 0.0
    wire_bytes: int = 0
    full_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0


class DeltaLedger(Protocol):
    """A sender's delta encodings, as its push reports read them."""

    def stats_for(self, version: int) -> DeltaStats | None:
        """The delta that carried ``version`` (None: it went whole)."""
        ...


class SlotHold(Protocol):
    """A hold on one version in the sender's snapshot ring: the slot is not overwritten while held."""

    def touch(self) -> None:
        """Still in use: the hold lasts another lease."""
        ...

    def release(self) -> None: ...

    def checksums(self) -> list[int] | None:
        """Per-bucket checksums of the held version (None: a GPU ring, or it was overwritten)."""
        ...


class Snapshots(Protocol):
    """The sender's snapshot ring, as the layers above the planes use it."""

    def hold(self, version: int) -> SlotHold | None:
        """Hold the slot that holds ``version`` complete; None when the ring no longer has it."""
        ...


class ReceiveSource(Protocol):
    """The data plane of one sender epoch, as ``WeightReceiver`` uses it.

    A plane's source subclasses it (the capabilities below default to None).
    """

    epoch: int

    def apply(self, held: int | None, sums: SumsLookup | None, reject: Reject) -> int | None:
        """Write one complete version above ``held`` into the module; return it (None: nothing newer)."""
        ...

    def pending_above(self, held: int | None) -> bool:
        """A complete version above ``held`` can be applied now."""
        ...

    def wait_change(self, until: float, give_up: Callable[[], bool]) -> bool:
        """Block until the source may have something new, ``until`` or ``give_up()``.

        Returns False when the source cannot tell (the caller then waits on the watcher).
        """
        ...

    def describe(self) -> str: ...

    def close(self) -> None: ...

    def lender(self) -> Lender | None:
        """Lends slots for zero-copy loads (shared memory on the trainer's host), else None."""
        return None

    def exact(self) -> ExactApply | None:
        """Applies a chosen version (a fleet's round), else None: the newest it has."""
        return None

    def host_link(self) -> HostLink | None:
        """Beats, acknowledges and hears news through a relay host's leader, else None: the store."""
        return None


class Peer(NamedTuple):
    """A receiver as a send plane sees it (the sender's membership hands these over)."""

    rid: int
    name: str
    host: str
    verify: bool  # wants the published checksums of each version


class Delivery(NamedTuple):
    """How one receiver (or its host) got one version, as a plane saw it: for push reports."""

    delta: bool  # as a delta against a version it held
    decode_s: float | None  # the receiver's decode time, when it reported one
    own: bool  # the receiver itself took it (a link); False: its host did (the relay's leader)


class SendPlane(Protocol):
    """One way a sender's versions leave its snapshot ring.

    The sender writes each version into the ring and then tells every plane; a plane
    never calls back into the sender. ``sync`` runs on the sender's background thread
    at each membership refresh; ``published`` right after a version's record is out.
    """

    def sync(self, live: Sequence[Peer], gone: Sequence[Peer], retired: Sequence[Peer]) -> None:
        """Follow the receivers: serve ``live`` ones, stop serving ``gone`` ones, free what ``retired`` ones held."""
        ...

    def published(self, version: int, live: Sequence[Peer]) -> None:
        """A version is in the ring and announced on the store."""
        ...

    def deliveries(self, version: int, peers: Sequence[Peer]) -> dict[str, Delivery]:
        """Receiver name -> how it got ``version``, for the receivers this plane served it to."""
        ...

    def failure(self, rid: int, version: int) -> str | None:
        """Why this plane cannot serve ``rid`` now, or cannot serve ``version`` at all, or None; the report of
        ``version`` asks, and a verdict on another version is not an answer."""
        ...

    @property
    def superseded(self) -> int:
        """Sends overwritten mid-send (a receiver stalled past the pin lease), over this plane's life."""
        ...

    def stop(self) -> None:
        """Ask every thread of the plane to end: a send waiting for a stalled receiver ends now,
        one already part-written to it at ``timeout_s`` (see :meth:`.wire.Interruptible.interrupt`)."""
        ...

    def close(self, deadline: float) -> list[str]:
        """Join the plane's threads against ``deadline`` (time.monotonic()); name what is still running."""
        ...
