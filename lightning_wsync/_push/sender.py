"""WeightSender: snapshot a module's weights into a flat buffer, deliver in the background.

::

    with WeightSender(model, store="127.0.0.1:29400", job="exp1") as sender:
        for step in range(1, 101):
            train_step()
            if step % 10 == 0:
                handle = sender.push(step)          # returns after the snapshot
        print(handle.wait(timeout_s=30))            # PushReport(version=100, delivered=..., failed=...)

``push`` blocks only while the weights are copied into the snapshot ring. A background
thread publishes the version on the store and tells the data planes
(:mod:`~lightning_wsync._planes`): receivers on this host copy it straight from the
shared-memory ring; other hosts get one copy each through the relay (or, with
``cross_host="star"``, each receiver over a process group of its own).

Longer than 300 lines: the public sender with its docstrings and its background step;
what varies by plane is in :mod:`~lightning_wsync._planes.open`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from types import TracebackType

import torch
import torch.distributed as dist
from torch import nn

from lightning_wsync._control import keys
from lightning_wsync._control.checks import Complaints
from lightning_wsync._control.fleet_records import FleetSwitch, FleetSwitches
from lightning_wsync._control.host import host_id, local_address
from lightning_wsync._control.manifest import build_manifest, select_tensors
from lightning_wsync._control.records import (
    ClosedRecord,
    ManifestRecord,
    SenderPointer,
    ShardsRecord,
    VersionRecord,
)
from lightning_wsync._control.retire import retire_old_epochs
from lightning_wsync._control.shards import Shares
from lightning_wsync._control.signing import resolve_secret
from lightning_wsync._control.store import (
    STORE_ERRORS,
    Control,
    StoreHandle,
    connect_store,
    resolve_job,
)
from lightning_wsync._planes.open import SenderSpec, SendSide, mirror_device
from lightning_wsync._push.fleet import FleetCoordinator
from lightning_wsync._push.membership import Membership
from lightning_wsync._push.report import PushHandle, Reporter
from lightning_wsync.config import SenderConfig, config_values
from lightning_wsync.errors import (
    WeightSyncAuthError,
    WeightSyncClosedError,
    WeightSyncRecordError,
    WeightSyncStoreError,
)

log = logging.getLogger(__name__)

_KEEP_VERSION_RECORDS = 4


class WeightSender:
    """Publishes versions of ``module``'s weights to every :class:`WeightReceiver` of a job.

    Args:
        module: the module whose parameters and persistent buffers are sent.
        store: a ``torch.distributed.Store``, or ``"host:port"`` (hosted here when the
            port is free or 0, else joined as a client). Default ``$WSYNC_STORE``.
        job: the job's name on the store (default ``$WSYNC_JOB``); overrides ``config.job``.
        config: a :class:`SenderConfig`; or pass its fields (``dtype``, ``bucket_mb``, ...)
            as keyword ``options``, not both.
        shares: trainer rank 0's part of a sharded push (made by the callback, with every
            other rank's ring named in its plan): the ring then holds rank 0's share only.
    """

    _latest_due = 0.0  # when _keep_latest next reads `latest` back
    _latest_said = False  # _keep_latest wrote it again once already (said at WARNING once)

    def __init__(
        self,
        module: nn.Module,
        store: dist.Store | str | None = None,
        job: str | None = None,
        *,
        config: SenderConfig | None = None,
        shares: Shares | None = None,
        **options: object,
    ) -> None:
        cfg = SenderConfig(**config_values(SenderConfig, config, options, owner="WeightSender", job=job))
        self.config = cfg
        self._tensors = _selected(module, cfg)
        job_name = resolve_job(cfg.job, "WeightSender")
        key = resolve_secret(cfg.secret, "WeightSender")
        self._store: StoreHandle = connect_store(store, serve=True, timeout_s=cfg.timeout_s, owner="WeightSender")
        self._ctl = Control(self._store.store, job_name, key)

        self.layout = build_manifest(self._tensors, cfg.wire_dtype, cfg.bucket_bytes)
        self._ordered = [self._tensors[e.name] for e in self.layout.entries]
        if shares is not None:  # sharded: the ring holds this rank's pieces
            self.layout, self._ordered = shares.layout, shares.sources
        self._host = host_id()
        self.epoch = self._ctl.add(keys.SENDER_EPOCH, 1)
        self.latest_version = self._latest_version()
        spec = SenderSpec(
            job=job_name, epoch=self.epoch, host=self._host, addr=local_address(self._store.address),
            transport=cfg.transport, cross_host=cfg.cross_host, delta=cfg.delta, cuda_ipc=cfg.cuda_ipc,
            device=next(iter(self._tensors.values())).device, timeout_s=cfg.timeout_s,
            heartbeat_timeout_s=cfg.heartbeat_timeout_s, shards=None if shares is None else shares.plan,
        )  # fmt: skip
        self._side = SendSide(self._ctl, self.layout, spec)
        self._ring = self._side.ring
        self._members = Membership(self._ctl, self._host, spec.timing)
        self._members_checked_at = 0.0  # the last full read of every member (see _refresh)
        self._complaints = Complaints(log, "the sender's background thread")
        self._published_versions: list[int] = []
        # Fleet receivers (ReceiverConfig.fleet) switch together: rounds on a thread started with the first.
        self._fleet = FleetCoordinator(self._ctl.clone(), self._members, self._side.holds, self._newest_published,
                                       spec.timing, partial=shares is not None)  # fmt: skip
        self._reporter = Reporter(self._ctl, self._members, lambda: self._side.planes, self._side.deltas,
                                  total_bytes=self.layout.total_bytes, timeout_s=cfg.timeout_s,
                                  fleet=self._fleet.switched_for)  # fmt: skip

        self._announce(spec)

        self._closed = False
        self._last_handle: PushHandle | None = None
        self._pending: list[PushHandle] = []
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_background, args=(weakref.ref(self), self._stop), name=f"wsync-sender-{job_name}", daemon=True
        )
        self._thread.start()
        log.info(
            "WeightSender job=%r epoch=%d: %d tensors, %.1f MiB, transport=%s, store=%s%s",
            job_name, self.epoch, len(self.layout.entries), self.layout.total_bytes / 2**20,
            cfg.transport, self._store.address, " (hosted here)" if self._store.is_server else "",
        )  # fmt: skip

    def _latest_version(self) -> int | None:
        """The version the previous sender published last (its record is deleted), if readable.

        A record signed with another secret fails the sender: it is the wrong secret here.
        """
        try:
            latest = self._ctl.get_record(keys.LATEST, VersionRecord)
        except WeightSyncRecordError as exc:
            log.error("WeightSender: %s", exc)
            return None
        return None if latest is None else latest.version

    def _announce(self, spec: SenderSpec) -> None:
        """Publish this epoch's layout and record, then point receivers at it."""
        self._ctl.put(keys.manifest(self.epoch), ManifestRecord(self.layout))
        if self._side.shards is not None:
            self._ctl.put(keys.shards(self.epoch), ShardsRecord(self._side.shards))
        self._ctl.put(keys.sender_record(self.epoch), self._side.record)
        self._ctl.put(keys.SENDER_CURRENT, SenderPointer(self.epoch))  # signed: receivers follow it
        self._ctl.bump(keys.NEWS)
        retire_old_epochs(self._ctl, self.epoch, self.latest_version)

    @property
    def store_address(self) -> str | None:
        """``host:port`` of the control-plane store (useful with ``store='host:0'``)."""
        return self._store.address

    @property
    def store(self) -> dist.Store:
        return self._store.store

    def push(self, version: int, *, wait_for_slot_s: float = 0.0) -> PushHandle:
        """Snapshot the weights as ``version`` and deliver them in the background.

        Blocks only for the copy into a free snapshot slot. When receivers are still
        reading both slots (pushes faster than their copies), the push is dropped at once
        (``handle.dropped``, counted in :attr:`dropped_pushes`) unless ``wait_for_slot_s``
        allows a bounded wait for one (use it for a run's final push).

        Raises:
            ValueError: ``version`` is not an int above the last published version.
            WeightSyncClosedError: the sender was closed.
        """
        if self._closed:
            raise WeightSyncClosedError("WeightSender.push() after close(); create a new WeightSender")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"WeightSender.push: version={version!r} must be an int >= 0 (e.g. the global step)")
        if self.latest_version is not None and version <= self.latest_version:
            raise ValueError(
                f"WeightSender.push: version={version!r} is not above the last published version "
                f"{self.latest_version} of job {self._ctl.job!r}; versions must strictly increase "
                f"(push a higher number, or use a new job name)"
            )
        started = time.perf_counter()
        written = self._ring.write(version, self._ordered, wait_s=wait_for_slot_s, wake=False)
        stall = time.perf_counter() - started
        if written is not None:
            self._ring.wake_readers()  # after the stall is timed: a woken reader may apply at once
        self.latest_version = version
        if written is None:
            first = self._ring.dropped == 1
            log.log(logging.WARNING if first else logging.DEBUG, "version %d dropped: every snapshot slot is being "
                    "read (receivers copying, a network send, a fleet round, or an engine worker's zero_copy loan, "
                    "held from its stage to its load); counted in dropped_pushes (wsync/dropped), the next push "
                    "carries newer weights%s", version, " (said for the first drop only)" if first else "")  # fmt: skip
            return PushHandle(self._reporter, version, started, stall, dropped=True)
        # The receivers live now (an in-memory view: push() never touches the store).
        handle = PushHandle(self._reporter, version, started, stall, targets=self._members.live())
        with self._wake:
            self._pending.append(handle)
            self._last_handle = handle
            self._wake.notify()
        log.debug("version %d snapshotted in %.4f s", version, stall)
        return handle

    # -- background ---------------------------------------------------------------
    def _publish_pending(self) -> None:
        with self._wake:
            pending, self._pending = self._pending, []
        if not pending:
            return
        newest = self._ring.newest()
        assert newest is not None
        version = newest.version
        ctl = self._ctl
        ctl.put(keys.version_record(version), VersionRecord(version, self.epoch))
        ctl.put(keys.LATEST, VersionRecord(version, self.epoch))
        ctl.bump(keys.NEWS)  # after every record of the version: a watcher that sees it finds them
        self._refresh_members(members=False)  # a receiver that registered just before the push is a target
        live = self._members.live()
        for handle in pending:
            handle.published(live)
        self._published_versions.append(version)
        while len(self._published_versions) > _KEEP_VERSION_RECORDS:
            old = self._published_versions.pop(0)
            for key in keys.version_keys(old):
                ctl.delete(key)
        peers = [m.peer for m in live]
        for plane in self._side.planes:
            plane.published(version, peers)

    def _keep_latest(self, now: float) -> None:
        """Every ``timing.backstop_s``, read ``latest`` back and write this sender's own again
        when something else replaced it (unreadable, absent, or an older version of this
        epoch). TCPStore orders requests per connection only, so a store writer's value can
        land after the sender's even when it was sent before: receivers that learn versions
        from ``latest`` (NIXL readers) then waited for the next push. A newer epoch's record
        is left alone (the job's newer sender wrote it)."""
        version = self._newest_published()
        if version is None or now < self._latest_due:
            return
        self._latest_due = now + self._side.timing.backstop_s
        mine = VersionRecord(version, self.epoch)
        try:
            held = self._ctl.get_record(keys.LATEST, VersionRecord)
        except (WeightSyncRecordError, WeightSyncAuthError):
            held = None  # reported by every reader that met it
        if held is not None and (held.epoch > self.epoch or held == mine):
            return
        self._ctl.put(keys.LATEST, mine)
        self._ctl.bump(keys.NEWS)
        log.log(logging.DEBUG if self._latest_said else logging.WARNING,
                "sender: 'latest' of job %r held %s, not version %d it published; written again%s", self._ctl.job,
                "an unreadable record" if held is None else f"version {held.version} of epoch {held.epoch}",
                version, "" if self._latest_said else " (said once)")  # fmt: skip
        self._latest_said = True

    def _newest_published(self) -> int | None:
        published = self._published_versions
        return published[-1] if published else None

    def _refresh_members(self, members: bool) -> None:
        self._members.refresh(members=members)
        if self._members.fleet_seen:
            self._fleet.start()

    def _refresh(self) -> None:
        """Follow the receivers, and hand every plane who is live, gone and retired.

        New registrations are taken in at every call; every member's heartbeat and goodbye
        are read every ``timing.member_check_s`` (at most a quarter of heartbeat_timeout_s), so the
        store's load from the sender grows with receivers at that pace, not at every call.
        """
        now = time.monotonic()
        full = now - self._members_checked_at >= self._side.timing.member_check_s
        self._refresh_members(members=full)
        if full:
            self._members_checked_at = now
        gone, retired = self._members.take_changes()
        live = [m.peer for m in self._members.live()]
        for plane in self._side.planes:
            plane.sync(live, gone, retired)

    @property
    def dropped_pushes(self) -> int:
        """Pushes not published because every snapshot slot was being read."""
        return self._ring.dropped

    @property
    def superseded_sends(self) -> int:
        """Network sends overwritten mid-send (a receiver stalled past the pin lease), over all links."""
        return sum(plane.superseded for plane in self._side.planes)

    def fleet_switches(self, group: str) -> list[FleetSwitch]:
        """The newest few switches of fleet ``group`` (receivers with ``fleet=group``), oldest first.

        Read from the store, as the group's receivers read them in ``update()``: the
        coordinator lists a switch only once it is stored, so its own list can trail what
        receivers already apply (it is the answer here only when the store cannot be read).
        """
        try:
            record = self._ctl.get_record(keys.fleet_switch(group), FleetSwitches)
        except STORE_ERRORS:  # the store gone (after close), a bad or forged record
            return self._fleet.switches(group)
        return [] if record is None else list(record.switches)

    def receivers(self) -> list[str]:
        """Names of the receivers currently considered live."""
        return [m.label for m in self._members.live()]

    # -- lifecycle ----------------------------------------------------------------
    def close(self, flush_timeout_s: float | None = None, *, final: bool = True) -> None:
        """Wait (bounded) for the last push to be delivered, then signal receivers and stop.

        Takes at most ``flush_timeout_s`` plus ``timeout_s`` in all, however many receivers
        are stalled (every link is told to stop first, then all are joined against one
        deadline), and frees the shared-memory ring and every thread even when the store
        is gone.

        Args:
            flush_timeout_s: bound on waiting for the last push; default ``timeout_s``;
                0 closes at once.
            final: True (default): training is finished, receivers see ``sender_closed``.
                False: this sender goes away but training may go on (an exception, a
                relaunch): receivers see ``sender_left`` and follow the next sender.
        """
        if self._closed:
            return
        last = self._last_handle
        try:
            if last is not None and flush_timeout_s != 0:
                last.wait(flush_timeout_s)
        except WeightSyncStoreError as exc:
            log.warning("close: the last push's delivery cannot be checked: %s", exc)
        self._closed = True
        deadline = time.monotonic() + self.config.timeout_s
        try:
            self._ctl.put(keys.closed(self.epoch), ClosedRecord(final))
            self._ctl.bump(keys.NEWS)
            for old in self._published_versions[:-1]:  # the newest goes when the next sender starts
                for key in keys.version_keys(old):
                    self._ctl.delete(key)
        except WeightSyncStoreError as exc:
            log.warning("could not signal close on the store: %s", exc)
        finally:
            self._stop_threads(deadline)
        log.info("WeightSender job=%r epoch=%d closed", self._ctl.job, self.epoch)

    def _stop_threads(self, deadline: float) -> None:
        """Signal every thread, join them all against ``deadline``, then free the ring."""
        try:
            self._stop.set()
            with self._wake:
                self._wake.notify()
            self._side.stop()  # ends sends blocked on stalled receivers now
            self._fleet.close()
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            stuck = self._side.close(deadline)
        if stuck:
            log.warning("close: %s still running at the deadline (timeout_s=%s)", ", ".join(stuck),
                        self.config.timeout_s)  # fmt: skip

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(flush_timeout_s=0 if exc_type is not None else None, final=exc_type is None)


def _selected(module: nn.Module, cfg: SenderConfig) -> dict[str, torch.Tensor]:
    """The tensors ``cfg`` selects from ``module``; a clear error when none, or when NCCL or
    CUDA IPC has no GPU to use."""
    tensors = select_tensors(module, cfg.include, cfg.exclude)
    if not tensors:
        names = list(module.state_dict().keys())[:5]
        raise ValueError(
            f"WeightSender: include={cfg.include!r} exclude={cfg.exclude!r} select no tensor of the "
            f"module (first names: {names!r}); loosen the patterns"
        )
    if cfg.transport == "nccl" and not any(t.is_cuda for t in tensors.values()):
        raise ValueError("WeightSender: transport='nccl' needs the module on a CUDA device; use 'gloo' for CPU")
    if cfg.cuda_ipc:
        mirror_device(list(tensors.values()), "WeightSender")
    return tensors


def _background(ref: weakref.ReferenceType[WeightSender], stop: threading.Event) -> None:
    """Publishes pushes and tracks receivers; holds the sender only weakly."""
    last_refresh = 0.0
    while not stop.is_set():
        sender = ref()
        if sender is None:
            return
        refresh_s = sender._side.timing.membership_refresh_s
        try:
            with sender._wake:
                if not sender._pending:
                    sender._wake.wait(timeout=refresh_s)
            if stop.is_set():
                return
            sender._publish_pending()
            now = time.monotonic()
            sender._keep_latest(now)
            if now - last_refresh >= refresh_s:
                sender._refresh()
                last_refresh = now
        except WeightSyncRecordError as exc:  # said once; skipped until its writer replaces it
            sender._complaints.bad("background", exc)
            stop.wait(0.2)
        except STORE_ERRORS as exc:  # the store, a forged record
            log.warning("sender background step failed (will retry): %s", str(exc).strip()[:300])
            stop.wait(0.2)
        except Exception:  # noqa: BLE001 - a dead publishing thread would fail every push silently
            log.exception("sender background step failed (will retry)")
            stop.wait(0.2)
        finally:
            del sender
