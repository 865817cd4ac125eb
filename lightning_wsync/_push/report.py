"""What a push returns: :class:`PushHandle` at once, :class:`PushReport` once its receivers are settled."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_wsync._push.membership import Member
    from lightning_wsync._push.sender import WeightSender


@dataclass(frozen=True)
class PushReport:
    """Outcome of one push.

    Attributes:
        version: the version pushed.
        delivered: receivers holding this version or a newer one (for receivers on this
            host: applied to their module; across hosts: staged and verified).
        failed: receiver name -> reason, for each receiver that was live when the
            version was published and did not get it within the timeout.
        stall_s: how long ``push()`` blocked the caller.
        latency_s: from ``push()`` to the last delivery seen (None if none).
        bytes: bytes in the snapshot.
        dropped: the push found every snapshot slot being read (pushes faster than
            receivers copy) and was not published; the next push carries newer weights.
        delta_receivers: network receivers that got this version as a delta (only the
            elements changed since the version they held; on a relay host: its leader
            did); the others got it in full.
        delta_bytes: bytes of that delta on the wire (compare with ``bytes``); None when
            no receiver got a delta.
        delta_changed_share: share of the wire dtype's elements that changed.
        delta_encode_s: the sender's time encoding the delta (once for all receivers).
        delta_decode_s: the slowest delta receiver's time rebuilding the version, when
            it reported it before this report was made (else None).
    """

    version: int
    delivered: tuple[str, ...]
    failed: dict[str, str] = field(default_factory=dict)
    stall_s: float = 0.0
    latency_s: float | None = None
    bytes: int = 0
    dropped: bool = False
    delta_receivers: tuple[str, ...] = ()
    delta_bytes: int | None = None
    delta_changed_share: float | None = None
    delta_encode_s: float | None = None
    delta_decode_s: float | None = None


class PushHandle:
    """Returned by :meth:`WeightSender.push`; ``wait()`` reports who got the version."""

    def __init__(
        self, sender: WeightSender, version: int, started: float, stall_s: float, *, dropped: bool = False
    ) -> None:
        self.version = version
        self.dropped = dropped
        self.stall_s = stall_s
        self._sender = sender
        self._started = started
        self._published = threading.Event()
        self._targets: list[Member] = []
        self._report: PushReport | None = None

    def _set_targets(self, targets: list[Member]) -> None:
        self._targets = targets
        self._published.set()

    def wait(self, timeout_s: float | None = None) -> PushReport:
        """Wait up to ``timeout_s`` (default: the sender's) for every receiver that was
        live at publication to hold this version; never longer."""
        if self._report is not None:
            return self._report
        if self.dropped:
            self._report = PushReport(
                self.version, (), stall_s=self.stall_s, bytes=self._sender.layout.total_bytes, dropped=True
            )
            return self._report
        timeout_s = self._sender.config.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        self._published.wait(timeout=timeout_s)
        self._report = self._sender._collect(self, self._targets, deadline, timeout_s)
        return self._report
