"""The data-plane interface: the send and receive sides every plane implements.

A plane is one subpackage of :mod:`lightning_wsync._planes` (``shm``, ``net``, ``relay``)
with a send side (:class:`SendPlane`, fed from the sender's snapshot ring) and a receive
side (:class:`ReceiveSource`, which applies versions into a receiver's tensors);
:mod:`lightning_wsync._planes.open` is the one place that picks them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

SumsLookup = Callable[[int], "list[int] | None"]  # version -> its published bucket checksums
Reject = Callable[[int, str], None]  # (version, reason)


class ReceiveSource(Protocol):
    """The data plane of one sender epoch, as ``WeightReceiver`` uses it."""

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

    def failure(self, rid: int) -> str | None:
        """Why this plane cannot serve ``rid`` now, or None."""
        ...

    @property
    def superseded(self) -> int:
        """Sends overwritten mid-send (a receiver stalled past the pin lease), over this plane's life."""
        ...

    def stop(self) -> None:
        """Ask every thread of the plane to end now (ends sends blocked on stalled receivers)."""
        ...

    def close(self, deadline: float) -> list[str]:
        """Join the plane's threads against ``deadline`` (time.monotonic()); name what is still running."""
        ...
