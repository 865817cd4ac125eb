"""WeightSender: snapshot a module's weights into a flat buffer, deliver in the background.

::

    with WeightSender(model, store="127.0.0.1:29400", job="exp1") as sender:
        for step in range(1, 101):
            train_step()
            if step % 10 == 0:
                handle = sender.push(step)          # returns after the snapshot
        print(handle.wait(timeout_s=30))            # PushReport(version=100, delivered=..., failed=...)

``push`` blocks only while the weights are copied into the snapshot buffer. A
background thread publishes the version on the store and, for receivers on other hosts,
per-receiver threads send it over their own process groups. Receivers on this host copy
it straight from the shared-memory snapshot.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from types import TracebackType

import torch
import torch.distributed as dist
from torch import nn

from lightning_wsync._control import keys
from lightning_wsync._control.host import host_id
from lightning_wsync._control.manifest import build_manifest, select_tensors
from lightning_wsync._control.store import (
    Control,
    StoreHandle,
    connect_store,
    local_address,
    resolve_job,
    resolve_secret,
    retire_old_epochs,
)
from lightning_wsync._planes.delta.encode import AutoPolicy, DeltaStreams
from lightning_wsync._planes.net.link import NetSendLink
from lightning_wsync._planes.relay.head import RelayHead, leader_record
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync._planes.shm.segment import ShmSegment, remove_stale_segments, segment_name
from lightning_wsync._push.membership import Member, Membership, decode_state
from lightning_wsync._push.report import PushHandle, PushReport
from lightning_wsync.config import SenderConfig, config_values
from lightning_wsync.errors import WeightSyncClosedError, WeightSyncStoreError

log = logging.getLogger(__name__)

_MEMBERSHIP_REFRESH_S = 0.05
_COLLECT_POLL_MIN_S = 0.0005
_COLLECT_POLL_MAX_S = 0.005
_KEEP_VERSION_RECORDS = 4
_PIN_LEASE_MAX_S = 5.0


class WeightSender:
    """Publishes versions of ``module``'s weights to every :class:`WeightReceiver` of a job.

    Args:
        module: the module whose parameters and persistent buffers are sent.
        store: a ``torch.distributed.Store``, or ``"host:port"`` (hosted here when the
            port is free or 0, else joined as a client). Default ``$WSYNC_STORE``.
        job: the job's name on the store (default ``$WSYNC_JOB``); overrides ``config.job``.
        config: a :class:`SenderConfig`; or pass its fields (``dtype``, ``bucket_mb``, ...)
            as keyword ``options``, not both.
    """

    def __init__(
        self,
        module: nn.Module,
        store: dist.Store | str | None = None,
        job: str | None = None,
        *,
        config: SenderConfig | None = None,
        **options: object,
    ) -> None:
        cfg = SenderConfig(**config_values(SenderConfig, config, options, owner="WeightSender", job=job))
        self.config = cfg
        self._tensors = select_tensors(module, cfg.include, cfg.exclude)
        if not self._tensors:
            names = list(module.state_dict().keys())[:5]
            raise ValueError(
                f"WeightSender: include={cfg.include!r} exclude={cfg.exclude!r} select no tensor of the "
                f"module (first names: {names!r}); loosen the patterns"
            )
        on_cuda = any(t.is_cuda for t in self._tensors.values())
        if cfg.transport == "nccl" and not on_cuda:
            raise ValueError("WeightSender: transport='nccl' needs the module on a CUDA device; use 'gloo' for CPU")
        job_name = resolve_job(cfg.job, "WeightSender")
        self._store: StoreHandle = connect_store(store, serve=True, timeout_s=cfg.timeout_s, owner="WeightSender")
        self._ctl = Control(self._store.store, job_name, resolve_secret(cfg.secret))
        self._report_ctl = self._ctl.clone()
        self._report_lock = threading.Lock()

        self.layout = build_manifest(self._tensors, cfg.wire_dtype, cfg.bucket_bytes)
        self._ordered = [self._tensors[e.name] for e in self.layout.entries]
        self._host = host_id()
        self._addr = local_address(self._store.address)
        self.epoch = self._ctl.add(keys.SENDER_EPOCH, 1)
        latest = self._ctl.get_json(keys.LATEST)
        self.latest_version: int | None = None if latest is None else int(latest["version"])

        # auto snapshots CUDA weights to host shared memory: same-host receivers (often on
        # the same GPU, where NCCL cannot pair two ranks) then copy them with no group.
        use_device = on_cuda and cfg.transport == "nccl"
        segment = None
        if not use_device and cfg.transport in ("auto", "shm"):
            remove_stale_segments()
            segment = ShmSegment(segment_name(job_name, self.epoch), self.layout.total_bytes, create=True, slots=2)
        device = next(iter(self._tensors.values())).device if use_device else torch.device("cpu")
        # A reader that makes no progress for this long no longer holds its slot.
        lease_s = min(cfg.timeout_s, cfg.heartbeat_timeout_s, _PIN_LEASE_MAX_S)
        self._ring = SnapshotRing(self.layout, segment=segment, device=device, slots=2, lease_s=lease_s)
        self._backend = "nccl" if use_device else "gloo"
        # Deltas between ring slots, for network receivers and the relay (scratch made with the first peer).
        self._deltas = DeltaStreams(self.layout) if cfg.delta != "off" and not use_device else None
        self._delta_policy = AutoPolicy(cfg.delta)
        self._members = Membership(self._ctl, self._host, cfg.heartbeat_timeout_s, epoch=self.epoch)
        # Receivers on other hosts: one copy into each host, relayed host to host (transport/relay.py).
        self._relay = (
            RelayHead(self._ctl, self._ring, epoch=self.epoch, backend=self._backend, addr=self._addr,
                      timeout_s=cfg.timeout_s, heartbeat_timeout_s=cfg.heartbeat_timeout_s, deltas=self._deltas,
                      policy=self._delta_policy)
            if cfg.transport == "auto" and cfg.cross_host == "relay" and not use_device
            else None
        )  # fmt: skip

        self._ctl.set_json(keys.manifest(self.epoch), self.layout.to_json())
        self._ctl.set_json(
            keys.sender_record(self.epoch),
            {
                "epoch": self.epoch,
                "host": self._host,
                "pid": os.getpid(),
                "transport": cfg.transport,
                "backend": self._backend,
                "shm": segment.name if segment is not None else None,
                "addr": self._addr,
                "relay": self._relay is not None,
                "heartbeat_timeout_s": cfg.heartbeat_timeout_s,
                "timeout_s": cfg.timeout_s,  # bounds every relay hop, whatever each receiver's own timeout_s
            },
        )
        self._ctl.set_json(keys.SENDER_CURRENT, {"epoch": self.epoch})  # signed: receivers follow it
        retire_old_epochs(self._ctl, self.epoch, self.latest_version)

        self._closed = False
        self._closed_superseded = 0
        self._last_handle: PushHandle | None = None
        self._pending: list[PushHandle] = []
        self._published_versions: list[int] = []
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
        handle = PushHandle(self, version, started, stall, dropped=written is None)
        if written is None:
            log.debug("version %d dropped: every snapshot slot is being read", version)
            return handle
        handle._targets = self._members.live()  # in-memory view; push() never touches the store
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
        ctl.set_json(keys.version_record(version), {"version": version, "epoch": self.epoch})
        ctl.set_json(keys.LATEST, {"version": version, "epoch": self.epoch})
        self._members.refresh()  # a receiver that registered just before the push is a target
        live = self._members.live()
        for handle in pending:  # receivers live at push time, plus any found since
            known = {m.rid for m in handle._targets}
            handle._set_targets(handle._targets + [m for m in live if m.rid not in known])
        self._published_versions.append(version)
        while len(self._published_versions) > _KEEP_VERSION_RECORDS:
            old = self._published_versions.pop(0)
            for key in keys.version_keys(old):
                ctl.delete(key)
        if self._ring.segment is not None and any(m.verify for m in live):
            # After the version is out, so receivers that do not verify are not delayed.
            lease = self._ring.acquire(newest)
            if lease is not None:  # None: already overwritten by the next push
                try:
                    sums = self._ring.checksums(lease)
                finally:
                    lease.release()
                if sums is not None:
                    ctl.set_json(keys.version_sums(version), {"version": version, "sums": sums})

    def _sync_links(self) -> None:
        for member in self._members.live():
            gen = self._ctl.add(keys.member_link(member.rid), 0)
            if gen == 0 or (member.link is not None and member.link.gen >= gen):
                continue
            if member.link is not None:
                member.link.close(timeout_s=0)
                self._closed_superseded += member.link.superseded
            if self._deltas is not None:
                self._deltas.prepare()
            member.link = NetSendLink(
                self._ctl, self._ring, epoch=self.epoch, rid=member.rid, gen=gen,
                backend=self._backend, addr=self._addr, timeout_s=self.config.timeout_s,
                deltas=self._deltas, policy=self._delta_policy,
            )  # fmt: skip

    def _sync_relay(self) -> None:
        """Keep the relay chain at the live host leaders (one per host other than this one)."""
        if self._relay is None:
            return
        live = {m.rid: m for m in self._members.live()}
        hosts = sorted({m.host for m in live.values() if m.host != self._host})
        leaders: dict[int, str] = {}
        for host in hosts:
            record = leader_record(self._ctl, self.epoch, host)
            if record is not None and int(str(record["rid"])) in live:
                leaders[int(str(record["rid"]))] = host
        self._relay.update_chain(leaders)

    def _collect(self, handle: PushHandle, targets: list[Member], deadline: float, timeout_s: float) -> PushReport:
        pending = {m.rid: m for m in targets}
        delivered: list[str] = []
        failed: dict[str, str] = {}
        last_delivery: float | None = None
        while pending:
            with self._report_lock:
                states = self._members.read_states(self._report_ctl, list(pending))
            for (rid, member), raw in zip(list(pending.items()), states):
                state = decode_state(self._report_ctl, rid, raw)
                if state.acked >= handle.version:
                    delivered.append(member.label)
                    last_delivery = time.perf_counter()
                elif (rejected := state.rejected) is not None and rejected.version >= handle.version:
                    failed[member.label] = f"rejected version {rejected.version}: {rejected.reason}"
                elif (reason := self._members.failure(rid)) is not None:
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
            elapsed = time.perf_counter() - handle._started
            time.sleep(min(_COLLECT_POLL_MAX_S, max(_COLLECT_POLL_MIN_S, elapsed / 100)))
        by_delta = [(m.label, m.link.delta_versions[handle.version]) for m in targets
                    if m.link is not None and handle.version in m.link.delta_versions]  # fmt: skip
        if self._relay is not None and self._deltas is not None:  # relay hosts: how their leader got it
            with self._report_lock:
                receipts = self._relay.receipts(self._report_ctl, handle.version)
            by_delta += [(m.label, receipts[m.host].decode_s) for m in targets
                         if m.host in receipts and receipts[m.host].delta and m.label not in failed]  # fmt: skip
        stats = self._deltas.stats_for(handle.version) if self._deltas is not None and by_delta else None
        decode_times = [t for _, t in by_delta if t is not None]
        return PushReport(
            version=handle.version,
            delivered=tuple(delivered),
            failed=failed,
            stall_s=handle.stall_s,
            latency_s=None if last_delivery is None else last_delivery - handle._started,
            bytes=self.layout.total_bytes,
            delta_receivers=tuple(label for label, _ in by_delta),
            delta_bytes=None if stats is None else stats.wire_bytes,
            delta_changed_share=None if stats is None else stats.changed_share,
            delta_encode_s=None if stats is None else stats.encode_s,
            delta_decode_s=max(decode_times) if decode_times else None,
        )

    @property
    def dropped_pushes(self) -> int:
        """Pushes not published because every snapshot slot was being read."""
        return self._ring.dropped

    @property
    def superseded_sends(self) -> int:
        """Network sends overwritten mid-send (a receiver stalled past the pin lease), over all links."""
        return sum(m.link.superseded for m in self._members.members() if m.link is not None) + self._closed_superseded

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
            self._ctl.set_json(keys.closed(self.epoch), {"final": final})
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
        links = [m.link for m in self._members.members() if m.link is not None]
        try:
            self._stop.set()
            with self._wake:
                self._wake.notify()
            for link in links:
                link.stop()  # ends a send blocked on a stalled receiver now
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
            self._ring.close()
            if self._relay is not None:
                self._relay.close(timeout_s=max(0.0, deadline - time.monotonic()))
            stuck = [link.rid for link in links if not link.join(deadline - time.monotonic())]
            if stuck:
                log.warning("close: links to receivers %s still running at the deadline (timeout_s=%s)", stuck,
                            self.config.timeout_s)  # fmt: skip
            if self._deltas is not None:
                self._deltas.close(timeout_s=max(0.0, deadline - time.monotonic()))
        finally:
            if self._ring.segment is not None:
                self._ring.segment.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(flush_timeout_s=0 if exc_type is not None else None, final=exc_type is None)


def _background(ref: weakref.ReferenceType[WeightSender], stop: threading.Event) -> None:
    """Publishes pushes and tracks receivers; holds the sender only weakly."""
    last_refresh = 0.0
    while not stop.is_set():
        sender = ref()
        if sender is None:
            return
        try:
            with sender._wake:
                if not sender._pending:
                    sender._wake.wait(timeout=_MEMBERSHIP_REFRESH_S)
            if stop.is_set():
                return
            sender._publish_pending()
            now = time.monotonic()
            if now - last_refresh >= _MEMBERSHIP_REFRESH_S:
                sender._members.refresh()
                sender._sync_links()
                sender._sync_relay()
                last_refresh = now
        except (RuntimeError, WeightSyncStoreError) as exc:
            log.warning("sender background step failed (will retry): %s", str(exc).strip()[:300])
            stop.wait(0.2)
        finally:
            del sender
