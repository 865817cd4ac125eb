"""The data-plane interface: what a receiver asks of the plane that brings it versions.

A plane is one subpackage of :mod:`lightning_wsync._planes` (``shm``, ``net``, ``relay``);
:mod:`lightning_wsync._planes.open` is the one place that picks a plane.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

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
