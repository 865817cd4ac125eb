"""The receiver's watcher: a background thread for heartbeats, acknowledgements and
following the sender.

It applies nothing: it keeps the receiver's view of the job current (the newest version
announced, the checksums to verify it with, which sender epoch to follow and through
which plane, whether the sender closed or left, whether the store answers) so that
``update()`` on the caller's thread never has to ask the store. A
:class:`~lightning_wsync._pull.receiver.WeightReceiver` owns one :class:`Watcher`.

Longer than 300 lines: one thread's steps over one state (heartbeat, versions, checksums,
close, sender switch); split by step, that state would travel between modules.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from lightning_wsync._control import keys
from lightning_wsync._control.checks import Complaints
from lightning_wsync._control.fleet_records import NOT_FOLLOWING, FleetAck
from lightning_wsync._control.host import local_address, pid_namespace
from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.member_state import StateReport
from lightning_wsync._control.records import (
    ClosedRecord,
    ManifestRecord,
    MemberRecord,
    SenderPointer,
    SenderRecord,
    SumsRecord,
    VersionRecord,
)
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import Timing, timing
from lightning_wsync._planes.base import HostLink, HostNews, HostTurn, Posted, ReceiveSource
from lightning_wsync._planes.open import ReceiverSpec, open_source
from lightning_wsync._pull.heartbeat import Heartbeat
from lightning_wsync.config import ReceiverConfig
from lightning_wsync.errors import (
    WeightSyncAuthError,
    WeightSyncConfigError,
    WeightSyncError,
    WeightSyncRecordError,
    WeightSyncSchemaError,
    WeightSyncStoreError,
)

log = logging.getLogger(__name__)

_EPOCH_SCAN = 16  # sender epochs looked back through when the newest does not verify
_OFF_HOST = HostTurn(board=None, posted=None, leads=False)  # no relay host: beats on and reads the store


class Published(NamedTuple):
    """A version as announced on the store."""

    version: int
    epoch: int


class PublishedSums(NamedTuple):
    """A published version's bucket checksums, fetched for ``update()`` with ``verify``."""

    version: int
    sums: list[int]


Bind = Callable[[Manifest], "list[torch.Tensor]"]  # a sender's layout -> the tensors to write, in its order


class Watcher:
    """Registers a receiver, then follows the job for it on a thread of its own.

    Args:
        ctl: the receiver's control (the watcher's thread uses a clone of it).
        bind: checks the receiver's tensors against a sender's layout and returns them
            in the layout's order (raises ``WeightSyncSchemaError`` when they differ).
        apply_lock: held by ``update()`` while it applies; the watcher takes it to swap planes.
    """

    def __init__(
        self, ctl: Control, config: ReceiverConfig, *, name: str, host: str, store_address: str | None,
        device: torch.device, bind: Bind, apply_lock: threading.Lock,
    ) -> None:  # fmt: skip
        self.name = name
        self.config = config
        self.rejected = 0  # versions refused on verification (checksum or signature)
        self.source: ReceiveSource | None = None
        self.latest: Published | None = None  # the newest version announced on the store
        self.error: WeightSyncError | None = None
        self.sender_closed = False
        self.sender_left = False
        self.store_lost_since: float | None = None
        self.cond = threading.Condition()  # notified when anything above moves on
        self._ctl = ctl
        self._watch_ctl = ctl.clone()
        self._host = host
        self._store_address = store_address
        self._device = device
        self._bind = bind
        self._apply_lock = apply_lock
        self._sums: PublishedSums | None = None  # with verify
        self._last_refusal = ""
        self._rejected_version = -2
        # epoch -> the sender record refused (looked at again once it changes), or None: for good
        self._refused_epochs: dict[int, str | None] = {}
        self._complaints = Complaints(log, f"receiver {name!r}")
        self._stop = threading.Event()
        self._kick = threading.Event()  # wakes the thread early (an ack to send, or stop)
        self._state = StateReport()
        self._heart = Heartbeat(self._state, self._complaints)
        self._applied: int | None = None  # the version update() last applied (for logs)
        # Every wait, from this receiver's settings and (once it follows one) its sender's record.
        self.timing: Timing = timing(heartbeat_timeout_s=0.0, timeout_s=config.timeout_s,
                                     heartbeat_s=config.heartbeat_s)  # fmt: skip
        self._latest_raw: str | None = None  # the `latest` record as last read (a relay leader passes it on)
        self._pointer_raw: str | None = None  # the sender pointer as last read (likewise)
        self.rid = -1
        self._register(ctl)
        self._thread = threading.Thread(target=self._watch, name=f"wsync-receiver-r{self.rid}", daemon=True)
        self._thread.start()

    # -- what update() and wait_for_version() ask -------------------------------------
    def held(self, version: int) -> None:
        """The receiver applied ``version``: acknowledge it now, not at the next poll."""
        self._applied = version
        self._state.held(version)
        self._kick.set()

    def published_sums(self, version: int) -> list[int] | None:
        held = self._sums
        return held.sums if held is not None and held.version == version else None

    def newer_pending(self, version: int | None) -> bool:
        source = self.source
        return source is not None and source.pending_above(version)

    def wait_for_news(self, until: float) -> None:
        """Block until something may have changed, or ``until``.

        From shared memory update() reads the segment's header itself, so a waiter watches
        the segment rather than waiting for the watcher's signal of the store's announcement.
        """
        source = self.source
        if source is not None and not self.config.verify:
            give_up = lambda: self.source is not source or bool(self.error or self.sender_closed)  # noqa: E731
            if source.wait_change(until, give_up):
                return
        with self.cond:  # the watcher (or a link's on_staged) notifies when something moves on
            self.cond.wait(timeout=max(0.0, until - time.monotonic()))

    def close(self) -> None:
        """Stop the thread, say goodbye on the store, and close the plane."""
        self._stop.set()
        self._kick.set()
        self._thread.join(timeout=10)
        try:
            self._state.write(self._ctl, force=self._heart.leave())
            self._ctl.set_json(keys.member_gone(self.rid), True)
            self._ctl.bump(keys.MEMBERS_GONE)  # the sender reads the gone keys when this moves
        except WeightSyncStoreError:
            pass  # store already gone: the sender sees the heartbeat stop instead
        with self._apply_lock:
            if self.source is not None:
                self.source.close()
                self.source = None

    # -- the thread -------------------------------------------------------------------
    def _watch(self) -> None:
        ctl = self._watch_ctl
        next_beat = next_all = next_news = 0.0
        news: str | None = None
        kicked = True
        while not self._stop.is_set():
            self._kick.clear()  # before the work: a kick during it makes the wait below return at once
            try:
                now = time.monotonic()
                relay = None if self.source is None else self.source.host_link()
                turn = _OFF_HOST if relay is None else relay.turn()  # a relay host's one question
                beat_s = self.timing.beat_s if relay is None else self.timing.hosted_beat_s  # timing.timing()
                next_beat = self._heart.tick(ctl, self.rid, now, next_beat, turn.board, beat_s, self._rejoin)
                # A relay host's leader woken for its heartbeat alone leaves news for a kick or its pace.
                if not (turn.leads and not kicked and now < min(next_news, next_all)):
                    news, next_all = self._follow(ctl, now, relay, turn.posted, news, next_all)
                    next_news = now + self._pace()
                if self.store_lost_since is not None:
                    log.info("receiver %r: store reachable again", self.name)
                    self.store_lost_since = None
            except WeightSyncStoreError as exc:  # the store boundary (Control); nothing else means "lost"
                if self.store_lost_since is None:
                    self.store_lost_since = time.monotonic()
                    log.warning("receiver %r: store %s unreachable (%s); keeping version %r", self.name,
                                self._store_address, str(exc).strip().splitlines()[0][:200], self._applied)  # fmt: skip
                    with self.cond:
                        self.cond.notify_all()
                self._stop.wait(self.timing.store_lost_retry_s)
            except Exception:  # noqa: BLE001 - the watcher must outlive any one bad step
                log.exception("receiver %r: watcher step failed; retrying", self.name)
                self._stop.wait(self.timing.store_lost_retry_s)
            kicked = self._kick.wait(min(self._pace(), max(0.0, next_beat - time.monotonic())))  # an apply kicks it

    def _follow(
        self, ctl: Control, now: float, relay: HostLink | None, posted: Posted | None, news: str | None,
        next_all: float,
    ) -> tuple[str | None, float]:  # fmt: skip
        """Read ``news`` and, when it moved (or is unreadable), when verify still lacks the newest
        version's checksums, and at ``next_all`` whatever happens, the records; returns the news
        read through (a lost store raises first: then it is all read again) and the next ``next_all``."""
        seen, taken = self._read_news(ctl, relay, None if posted is None else posted.news, news)
        look = seen is None or (seen != news and not taken) or now >= next_all or self._sums_missing()
        if now >= next_all:
            next_all = now + (self.timing.backstop_s if relay is None else self.timing.hosted_backstop_s)
        steps = (self._follow_sender, self._follow_close, self._follow_versions, self._follow_sums)
        for step in steps if look else ():
            try:
                step(ctl)
                self._complaints.good(step.__name__)
            except WeightSyncAuthError as exc:
                self._refuse(exc)
            except WeightSyncRecordError as exc:  # ignored until its writer replaces it
                self._complaints.bad(step.__name__, exc)
        if relay is not None and posted is None:  # the host's leader tells its host-mates
            relay.share_news(HostNews(seen, self._latest_raw, self._pointer_raw,
                                      self.sender_closed or self.sender_left))  # fmt: skip
        return seen, next_all

    def _pace(self) -> float:
        """How long the thread waits for a kick (it wakes for its heartbeats as well); on a relay
        host, as its link says (:meth:`HostLink.pace`: a leader is kicked by each version)."""
        t, source = self.timing, self.source
        if source is None:
            return t.seek_poll_s
        if self.config.verify:
            return t.verify_poll_s
        link = source.host_link()
        return t.idle_poll_s if link is None else link.pace(t, self.sender_closed or self.sender_left)

    def _read_news(
        self, ctl: Control, relay: HostLink | None, posted: HostNews | None, news: str | None
    ) -> tuple[str | None, bool]:
        """The ``news`` counter as written (None when absent: then every record is read), and
        whether what moved was taken in already (then the records need not be read): a relay
        host-mate reads it off its leader's board (``posted``, :meth:`HostLink.read_news`)."""
        if posted is None or relay is None:
            return ctl.get_text(keys.NEWS), False
        read = relay.read_news(ctl, posted, news, self._latest_raw)
        if read.latest is not None and posted.latest is not None:
            self._take_latest(read.latest, posted.latest)
        return read.seen, read.taken

    def _sums_missing(self) -> bool:
        latest, held = self.latest, self._sums
        return self.config.verify and latest is not None and (held is None or held.version != latest.version)

    def _register(self, ctl: Control) -> None:
        """Take a fresh receiver id and announce this receiver under it."""
        self.rid = ctl.add(keys.MEMBERS_NEXT, 1) - 1
        self._state.moved_to(self.rid)
        self._state.write(ctl, force=True)
        self._heart.count = ctl.add(keys.member_heartbeat(self.rid), 1)
        if self.config.fleet is not None:  # before the record: the sender reads it for every fleet member
            ctl.put(keys.member_fleet(self.rid), FleetAck(self.config.fleet, round=NOT_FOLLOWING))
        me = MemberRecord(self.name, self._host, os.getpid(), pid_namespace(), self.config.verify, self.config.fleet)
        ctl.put(keys.member(self.rid), me)

    def _rejoin(self, ctl: Control) -> None:
        """The sender forgot this receiver (silent past its patience: paused, partitioned):
        register again and reopen the data plane under the new id, keeping the version held."""
        old = self.rid
        self._register(ctl)
        ctl.delete(keys.member_heartbeat(old))  # re-created by the add that found it gone
        log.warning("receiver %r was forgotten by the sender while silent (rid=%d); registered again as rid=%d",
                    self.name, old, self.rid)  # fmt: skip
        source = self.source
        if source is None:
            return
        record = ctl.get_record(keys.sender_record(source.epoch), SenderRecord)
        layout = ctl.get_record(keys.manifest(source.epoch), ManifestRecord)
        if record is not None and layout is not None:
            self._switch(ctl, source.epoch, record, layout.layout)

    def _follow_versions(self, ctl: Control) -> None:
        source = self.source
        if isinstance(self.error, WeightSyncSchemaError):
            latest = ctl.get_record(keys.LATEST, VersionRecord)
            version = -1 if latest is None else latest.version
            if version > self._rejected_version:  # tell the sender, version by version
                self._rejected_version = version
                self._state.rejected(version, str(self.error))
            return
        if source is None:
            return
        # `latest` is never deleted once written: after the first sighting, a plain get.
        raw = ctl.get_text(keys.LATEST) if self.latest is None else ctl.get_raw(keys.LATEST).decode("utf-8", "replace")
        if raw is not None:
            self._take_latest(ctl.decode(keys.LATEST, raw, VersionRecord), raw)

    def _take_latest(self, latest: VersionRecord, raw: str) -> None:
        self._latest_raw = raw
        record = Published(latest.version, latest.epoch)
        if record != self.latest and (self.latest is None or record.version > self.latest.version):
            with self.cond:
                self.latest = record
                self.cond.notify_all()

    def _follow_sums(self, ctl: Control) -> None:
        """With ``verify``, fetch the checksums of the newest shared version for update()."""
        latest, held = self.latest, self._sums
        if not self.config.verify or latest is None or (held is not None and held.version == latest.version):
            return
        record = ctl.get_record(keys.version_sums(latest.version), SumsRecord)
        if record is not None and record.version == latest.version:
            self._sums = PublishedSums(latest.version, list(record.sums))
            with self.cond:
                self.cond.notify_all()

    def _follow_close(self, ctl: Control) -> None:
        source = self.source
        if source is None:
            return
        closed_key = keys.closed(source.epoch)
        if not (self.sender_closed or self.sender_left) and ctl.has(closed_key):
            self._on_closed(ctl.get_record(closed_key, ClosedRecord))

    def _on_closed(self, record: ClosedRecord | None) -> None:
        """``closed/<epoch>``: final (training finished) or not (the sender may come back)."""
        final = record is not None and record.final
        with self.cond:
            if final:
                self.sender_closed = True
            else:
                self.sender_left = True
            self.cond.notify_all()

    def _refuse(self, exc: WeightSyncError) -> None:
        """A record failed authentication, or a sender cannot be used from here (a
        configuration error): fatal before a valid sender is known, else ignored."""
        if self.source is None:
            self.error = exc
            with self.cond:
                self.cond.notify_all()
            self._stop.set()
        if str(exc) != self._last_refusal:
            log.error("receiver %r refused a record: %s", self.name, exc)
            self._last_refusal = str(exc)

    def _follow_sender(self, ctl: Control) -> None:
        """Switch to the newest sender epoch whose records verify (a forged pointer is skipped)."""
        raw = ctl.get_text(keys.SENDER_CURRENT)
        if raw is None:
            return
        pointer = ctl.decode(keys.SENDER_CURRENT, raw, SenderPointer)  # signed with a secret: a forged one raises
        self._pointer_raw = raw  # a relay leader posts it for its host-mates
        current = pointer.epoch
        floor = self.source.epoch if self.source is not None else 0
        if current <= floor:
            return
        refusal: WeightSyncAuthError | None = None
        for epoch in range(current, max(floor, current - _EPOCH_SCAN), -1):
            key = keys.sender_record(epoch)
            if epoch in self._refused_epochs and self._refused_epochs[epoch] is None:
                continue
            raw = ctl.get_text(key)
            if raw is None or self._refused_epochs.get(epoch) == raw:
                continue
            self._refused_epochs.pop(epoch, None)
            try:
                record = ctl.decode(key, raw, SenderRecord)
                layout = ctl.get_record(keys.manifest(epoch), ManifestRecord)
            except WeightSyncAuthError as exc:
                self._refused_epochs[epoch] = raw
                refusal = exc
                continue
            except WeightSyncRecordError as exc:
                self._refused_epochs[epoch] = raw
                self._complaints.bad(key, exc)
                continue
            if layout is not None:
                self._switch(ctl, epoch, record, layout.layout)
                return
        if refusal is not None:
            self._refuse(refusal)

    def _switch(self, ctl: Control, epoch: int, record: SenderRecord, layout: Manifest) -> None:
        closed_key = keys.closed(epoch)
        try:
            ordered = self._bind(layout)
            # A sender that has ended leaves no segment: that is not a reason for the network path.
            source = self._make_source(epoch, layout, record, ordered, fallback=not ctl.has(closed_key))
        except WeightSyncSchemaError as exc:
            self.error = exc  # raised by update()/wait_for_version(); reported on each version
            log.error("%s", exc)
            with self.cond:
                self.cond.notify_all()
            return
        except OSError as exc:  # its shared segment is gone: that sender has ended
            self._refused_epochs[epoch] = None
            log.warning("receiver %r: sender epoch %d cannot be read (%s)", self.name, epoch, exc)
            if ctl.has(closed_key):
                self._on_closed(ctl.get_record(closed_key, ClosedRecord))
            return
        except WeightSyncStoreError:
            raise
        except WeightSyncError as exc:  # transport='shm' across hosts, a segment that is not ours
            self._refused_epochs[epoch] = None
            self._refuse(exc if isinstance(exc, WeightSyncConfigError) else WeightSyncConfigError(str(exc)))
            return
        self.timing = timing(heartbeat_timeout_s=record.heartbeat_timeout_s, timeout_s=self.config.timeout_s,
                             heartbeat_s=self.config.heartbeat_s)  # fmt: skip
        with self._apply_lock:
            old, self.source = self.source, source
            self.sender_closed = self.sender_left = False
        # Outside the lock: closing a plane can take a while (a relay thread joining), and
        # update() must not wait for it; nothing reaches the old source once it is swapped out.
        if old is not None:
            old.close()
        log.info("receiver %r follows sender epoch %d (%s)", self.name, epoch, source.describe())

    def _make_source(
        self, epoch: int, layout: Manifest, record: SenderRecord, ordered: list[torch.Tensor], *, fallback: bool
    ) -> ReceiveSource:
        me = ReceiverSpec(
            ctl=self._ctl, rid=self.rid, host=self._host, name=self.name, addr=local_address(self._store_address),
            device=self._device, timeout_s=self.config.timeout_s, swap=self.config.apply == "swap",
            on_staged=self._on_staged, on_rejected=self.on_rejected,
            newest=lambda: None if self.latest is None else self.latest.version, on_rung=self._kick.set,
        )  # fmt: skip
        return open_source(epoch, layout, record, ordered, me, fallback=fallback)

    def _on_staged(self, version: int) -> None:
        self._state.held(version)
        self._kick.set()  # the watcher acknowledges it now, not at its next (slow) poll
        with self.cond:
            self.cond.notify_all()

    def on_rejected(self, version: int, reason: str) -> None:
        self.rejected += 1
        log.warning("receiver %r rejected version %d: %s", self.name, version, reason)
        self._state.rejected(version, reason)
        self._kick.set()
