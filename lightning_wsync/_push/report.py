"""What a push returns: :class:`PushHandle` at once, :class:`PushReport` once its receivers are settled."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from lightning_wsync._control import keys
from lightning_wsync._control.checks import Complaints
from lightning_wsync._control.fleet_records import FleetSwitch
from lightning_wsync._control.member_state import decode_state
from lightning_wsync._control.store import Control
from lightning_wsync._planes.base import DeltaLedger, SendPlane
from lightning_wsync._push.membership import Member, Membership
from lightning_wsync.errors import WeightSyncAuthError, WeightSyncRecordError

log = logging.getLogger(__name__)

_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.005


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
        fleet: per fleet group (``ReceiverConfig.fleet``), its first switch to this version
            or a newer one, when it happened before this report was made: the version,
            ``at`` (``time.time()`` on the sender), the receiver ids that switched and
            ``excluded`` (name -> why it was left out).
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
    fleet: Mapping[str, FleetSwitch] = field(default_factory=dict)


class PushHandle:
    """Returned by :meth:`WeightSender.push`; ``wait()`` reports who got the version."""

    def __init__(
        self, reporter: Reporter, version: int, started: float, stall_s: float, *, dropped: bool = False,
        targets: Sequence[Member] = (),
    ) -> None:  # fmt: skip
        self.version = version
        self.dropped = dropped
        self.stall_s = stall_s
        self.started = started
        self._reporter = reporter
        self._published = threading.Event()
        self._targets: list[Member] = list(targets)
        self._report: PushReport | None = None

    def published(self, live: Sequence[Member]) -> None:
        """The version is announced: its targets are the receivers live at push time plus any found since."""
        known = {m.rid for m in self._targets}
        self._targets += [m for m in live if m.rid not in known]
        self._published.set()

    def wait(self, timeout_s: float | None = None) -> PushReport:
        """Wait up to ``timeout_s`` (default: the sender's) for every receiver that was
        live at publication to hold this version; never longer."""
        if self._report is None:
            timeout_s = self._reporter.timeout_s if timeout_s is None else timeout_s
            deadline = time.monotonic() + timeout_s
            if not self.dropped:
                self._published.wait(timeout=timeout_s)
            self._report = self._reporter.collect(self, self._targets, deadline, timeout_s)
        return self._report


class Reporter:
    """Builds push reports from what the receivers acknowledge on the store and what the
    planes saw; it holds the sender's pieces, never the sender."""

    def __init__(
        self, ctl: Control, members: Membership, planes: Callable[[], Sequence[SendPlane]],
        deltas: DeltaLedger | None, *, total_bytes: int, timeout_s: float,
        fleet: Callable[[int], Mapping[str, FleetSwitch]] = lambda version: {},
    ) -> None:  # fmt: skip
        self._ctl = ctl.clone()
        self._lock = threading.Lock()
        self._members = members
        self._planes = planes
        self._deltas = deltas
        self._bytes = total_bytes
        self.timeout_s = timeout_s
        self._complaints = Complaints(log, "push report")
        self._fleet = fleet

    def collect(self, handle: PushHandle, targets: list[Member], deadline: float, timeout_s: float) -> PushReport:
        if handle.dropped:
            return PushReport(handle.version, (), stall_s=handle.stall_s, bytes=self._bytes, dropped=True)
        known = {m.rid for m in targets}  # left out at the push only because this view was stale: targets too
        targets = [*targets, *(m for m in self._members.recheck_silent() if m.rid not in known)]
        delivered, failed, last = self._settle(handle, targets, deadline, timeout_s)
        return self._report(handle, targets, delivered, failed, last)

    def _failure(self, rid: int, version: int) -> str | None:
        reason = self._members.failure(rid)
        for plane in self._planes():
            reason = reason or plane.failure(rid, version)
        return reason

    def _settle(
        self, handle: PushHandle, targets: list[Member], deadline: float, timeout_s: float
    ) -> tuple[list[str], dict[str, str], float | None]:
        """Poll the targets' states until each has the version, refused it, or failed."""
        pending = {m.rid: m for m in targets}
        delivered: list[str] = []
        failed: dict[str, str] = {}
        last_delivery: float | None = None
        while pending:
            if any(self._members.is_silent(rid) for rid in pending):
                self._members.recheck_silent()  # never fail a target on a stale view: ask the store
            with self._lock:
                states = self._members.read_states(self._ctl, list(pending))
            for (rid, member), raw in zip(list(pending.items()), states):
                try:
                    state = decode_state(self._ctl, rid, raw)
                    self._complaints.good(keys.member_state(rid))
                except (WeightSyncRecordError, WeightSyncAuthError) as exc:  # as if it said nothing yet
                    self._complaints.bad(keys.member_state(rid), exc)
                    if (reason := self._failure(rid, handle.version)) is not None:
                        failed[member.label] = reason
                        del pending[rid]
                    continue
                if state.acked >= handle.version:
                    delivered.append(member.label)
                    last_delivery = time.perf_counter()
                elif (rejected := state.rejected) is not None and rejected.version >= handle.version:
                    failed[member.label] = f"rejected version {rejected.version}: {rejected.reason}"
                elif (reason := self._failure(rid, handle.version)) is not None:
                    failed[member.label] = reason
                else:
                    continue
                del pending[rid]
            if not pending:
                break
            if time.monotonic() >= deadline:
                for rid, member in pending.items():
                    age = self._members.heartbeat_age_s(rid)
                    failed[member.label] = (
                        f"no acknowledgement of version {handle.version} within timeout_s={timeout_s} "
                        f"(last heartbeat {age:.1f} s ago); it is stalled or slow: check it, or raise timeout_s"
                    )
                break
            # Poll often at first (small pushes), then at 1% of the time spent so far: the
            # report's latency stays within ~1% while a long push costs the store few requests.
            elapsed = time.perf_counter() - handle.started
            time.sleep(min(_POLL_MAX_S, max(_POLL_MIN_S, elapsed / 100)))
        return delivered, failed, last_delivery

    def _report(
        self, handle: PushHandle, targets: list[Member], delivered: list[str], failed: dict[str, str],
        last_delivery: float | None,
    ) -> PushReport:  # fmt: skip
        peers = [m.peer for m in targets]
        by_delta: dict[str, float | None] = {}
        for plane in self._planes():
            seen = plane.deliveries(handle.version, peers)
            # A receiver that failed after its host got the delta did not get it; one that took it and refused it did.
            by_delta.update({name: d.decode_s for name, d in seen.items() if d.delta and (d.own or name not in failed)})
        stats = self._deltas.stats_for(handle.version) if self._deltas is not None and by_delta else None
        decode_times = [t for t in by_delta.values() if t is not None]
        return PushReport(
            version=handle.version,
            delivered=tuple(delivered),
            failed=failed,
            stall_s=handle.stall_s,
            latency_s=None if last_delivery is None else last_delivery - handle.started,
            bytes=self._bytes,
            delta_receivers=tuple(by_delta),
            delta_bytes=None if stats is None else stats.wire_bytes,
            delta_changed_share=None if stats is None else stats.changed_share,
            delta_encode_s=None if stats is None else stats.encode_s,
            delta_decode_s=max(decode_times) if decode_times else None,
            fleet=dict(self._fleet(handle.version)),
        )
