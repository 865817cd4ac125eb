"""WeightReceiver: keep a rollout module at the newest complete version, applied on request.

::

    policy = Policy()
    with WeightReceiver(policy) as receiver:            # store and job from WSYNC_* env
        receiver.wait_for_version(0, timeout_s=60)      # the initial weights
        while True:
            run_rollout(policy)
            receiver.update()                           # newest complete version, if newer

A background thread registers the receiver, sends heartbeats and watches the store for
new versions and sender restarts. From a sender on this host, ``update()`` copies the
shared snapshot straight into the module (torn copies are detected and redone); from a
sender on another host, a network link stages each version privately and verifies it
first. Either way the module is only ever written by ``update()`` on the caller's
thread, and only with a complete version.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from lightning_wsync._control import (
    Control,
    connect_store,
    default_receiver_name,
    host_id,
    local_address,
    resolve_job,
    resolve_secret,
)
from lightning_wsync._manifest import Layout, select_tensors
from lightning_wsync._membership import StateReport
from lightning_wsync.config import ReceiverConfig, resolve_config
from lightning_wsync.errors import (
    WeightSyncAuthError,
    WeightSyncClosedError,
    WeightSyncError,
    WeightSyncIntegrityError,
    WeightSyncSchemaError,
    WeightSyncStoreError,
    WeightSyncTimeoutError,
)
from lightning_wsync.transport.net import NetReceiveLink
from lightning_wsync._source import ReceiveSource, open_source

log = logging.getLogger(__name__)

_POLL_S = 0.002
_SLOW_POLL_S = 0.05
_EPOCH_SCAN = 16  # sender epochs looked back through when the newest does not verify


class Published(NamedTuple):
    """A version as announced on the store."""

    version: int
    epoch: int


class WeightReceiver:
    """Receives the versions a :class:`WeightSender` publishes into ``module``.

    Args:
        module: the rollout module; its parameters and buffers are updated in place.
        store: a ``torch.distributed.Store`` or ``"host:port"`` (always joined as a
            client). Default ``$WSYNC_STORE``.
        config: a :class:`ReceiverConfig`; or pass its fields as keyword arguments.
    """

    def __init__(
        self,
        module: nn.Module,
        store: dist.Store | str | None = None,
        job: str | None = None,
        *,
        name: str | None = None,
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
        timeout_s: float = 30.0,
        heartbeat_s: float = 0.5,
        secret: str | None = None,
        verify: bool = False,
        apply: str = "copy",
        config: ReceiverConfig | None = None,
    ) -> None:
        options: dict[str, object] = {
            "name": name, "include": include, "exclude": exclude, "timeout_s": timeout_s,
            "heartbeat_s": heartbeat_s, "secret": secret, "verify": verify, "apply": apply,
        }  # fmt: skip
        cfg = resolve_config(ReceiverConfig, config, "WeightReceiver", job, options)
        self.config = cfg
        self._tensors = select_tensors(module, cfg.include, cfg.exclude)
        job_name = resolve_job(cfg.job, "WeightReceiver")
        handle = connect_store(store, serve=False, timeout_s=cfg.timeout_s, owner="WeightReceiver")
        self._store_address = handle.address
        self._ctl = Control(handle.store, job_name, resolve_secret(cfg.secret))
        self._watch_ctl = self._ctl.clone()
        self._host = host_id()
        self._device = next(iter(self._tensors.values())).device if self._tensors else torch.device("cpu")

        self.version: int | None = None
        self.rejected = 0  # versions refused on verification (checksum or signature)
        self._source: ReceiveSource | None = None
        self._latest: Published | None = None  # the newest version announced on the store
        self._error: WeightSyncError | None = None
        self._last_refusal = ""
        self._sums: tuple[int, list[int]] | None = None  # (version, checksums) with verify
        self._store_lost_since: float | None = None
        self._rejected_version = -2
        self._refused_epochs: set[int] = set()
        self._sender_closed = False
        self._closed = False
        self._cond = threading.Condition()
        self._apply_lock = threading.Lock()
        self._stop = threading.Event()
        self._kick = threading.Event()  # wakes the watcher early (an ack to send, or stop)

        self.rid = self._ctl.add("members/next", 1) - 1
        self.name = cfg.name or default_receiver_name()
        self._state = StateReport(self.rid)
        self._state.write(self._ctl, force=True)
        self._ctl.add(f"member/{self.rid}/hb", 1)
        self._ctl.set_json(
            f"member/{self.rid}", {"name": self.name, "host": self._host, "pid": os.getpid(), "verify": cfg.verify}
        )
        self._thread = threading.Thread(target=self._watch, name=f"wsync-receiver-r{self.rid}", daemon=True)
        self._thread.start()
        log.info("WeightReceiver %r (rid=%d) joined job %r", self.name, self.rid, job_name)

    # -- user API -----------------------------------------------------------------
    def update(self) -> int | None:
        """Apply the newest complete version if it is newer than the one held.

        Never waits on the network or on the sender: it copies a pinned shared-memory
        slot or a version already staged. Returns the version applied, or None. After it
        returns or raises, the module holds one complete version and :attr:`version` names
        it (None only after a :class:`WeightSyncIntegrityError`).
        """
        self._raise_if_unusable()
        with self._apply_lock:
            source = self._source
            if source is None:
                return None
            try:
                applied = source.apply(
                    self.version, self._published_sums if self.config.verify else None, self._on_rejected
                )
            except WeightSyncIntegrityError:
                self.version = None  # the module may hold a torn copy now; say so
                raise
        if applied is not None:
            self.version = applied
            self._state.held(applied)
            self._kick.set()  # the watcher writes the acknowledgement now, not at its next poll
            log.debug("applied version %d", applied)
        return applied

    def wait_for_version(self, min_version: int = 0, timeout_s: float | None = None) -> int:
        """Block until a version >= ``min_version`` is applied to the module; return it.

        Raises:
            WeightSyncTimeoutError: none arrived within ``timeout_s`` (default: the config's).
            WeightSyncClosedError: the sender closed before publishing such a version.
            WeightSyncSchemaError: this module does not match what the sender publishes.
        """
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            self.update()
            if self.version is not None and self.version >= min_version:
                return self.version
            if self._sender_closed and not self._newer_pending():
                raise WeightSyncClosedError(
                    f"WeightReceiver {self.name!r}: the sender of job {self._ctl.job!r} closed; the newest "
                    f"version held is {self.version!r}, below min_version={min_version!r}"
                )
            lost = self._store_lost_since
            if lost is not None and time.monotonic() - lost >= timeout_s:
                raise WeightSyncStoreError(
                    f"WeightReceiver {self.name!r}: the control-plane store {self._store_address!r} has been "
                    f"unreachable for {time.monotonic() - lost:.1f} s; the module keeps version {self.version!r}. "
                    f"The trainer (or `lightning-wsync store`) is gone: restart it, or exit and let torchrun restart this worker"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                latest = self.latest_published
                raise WeightSyncTimeoutError(
                    f"WeightReceiver {self.name!r}: no version >= {min_version!r} within timeout_s={timeout_s} "
                    f"(held {self.version!r}, newest published {latest!r}, job {self._ctl.job!r} on store "
                    f"{self._store_address!r}); is the trainer pushing? raise timeout_s otherwise"
                )
            self._wait_for_news_until(time.monotonic() + min(remaining, _SLOW_POLL_S))

    @property
    def latest_published(self) -> int | None:
        """Newest version the sender has published (as last seen on the store)."""
        return None if self._latest is None else self._latest.version

    @property
    def sender_closed(self) -> bool:
        """The sender announced its close (no newer version will come from it)."""
        return self._sender_closed

    @property
    def store_lost_s(self) -> float | None:
        """Seconds since the store became unreachable, or None while it answers."""
        lost = self._store_lost_since
        return None if lost is None else time.monotonic() - lost

    # -- applying -------------------------------------------------------------------
    def _wait_for_news_until(self, until: float) -> None:
        """Block until something may have changed, or ``until``.

        From shared memory update() reads the segment's header itself, so a waiter watches
        the segment rather than waiting for the watcher's signal of the store's announcement.
        """
        source = self._source
        if source is not None and not self.config.verify:
            give_up = lambda: self._source is not source or bool(self._error or self._sender_closed)  # noqa: E731
            if source.wait_change(until, give_up):
                return
        with self._cond:  # the watcher (or a link's on_staged) notifies when something moves on
            self._cond.wait(timeout=max(0.0, until - time.monotonic()))

    def _newer_pending(self) -> bool:
        source = self._source
        return source is not None and source.pending_above(self.version)

    def _raise_if_unusable(self) -> None:
        if self._closed:
            raise WeightSyncClosedError(f"WeightReceiver {self.name!r} is closed; create a new one")
        if self._error is not None:
            raise self._error

    # -- background ---------------------------------------------------------------
    def _watch(self) -> None:
        ctl = self._watch_ctl
        next_beat = next_slow = 0.0
        fast = True
        while not self._stop.is_set():
            self._kick.clear()  # before the work: a kick during it makes the wait below return at once
            try:
                now = time.monotonic()
                if now >= next_beat:
                    ctl.add(f"member/{self.rid}/hb", 1)
                    next_beat = now + self.config.heartbeat_s
                self._state.write(ctl)
                # Sender changes and the close signal are looked at every _SLOW_POLL_S.
                slow, next_slow = now >= next_slow, (now + _SLOW_POLL_S if now >= next_slow else next_slow)
                # Versions arrive through a network link itself, and a shared segment's header
                # is read by update() directly: then `latest` only feeds latest_published and
                # is read at the slow pace too. With verify, the published checksums are needed.
                source = self._source
                fast = source is None or self.config.verify
                steps = ((self._follow_sender, self._follow_close) if slow else ()) + (
                    (self._follow_versions, self._follow_sums) if fast or slow else ()
                )
                for step in steps:
                    try:
                        step(ctl)
                    except WeightSyncAuthError as exc:
                        self._refuse(exc)
                if self._store_lost_since is not None:
                    log.info("receiver %r: store reachable again", self.name)
                    self._store_lost_since = None
            except RuntimeError as exc:
                if self._store_lost_since is None:
                    self._store_lost_since = time.monotonic()
                    log.warning("receiver %r: store %s unreachable (%s); keeping version %r", self.name,
                                self._store_address, str(exc).strip().splitlines()[0][:200], self.version)  # fmt: skip
                    with self._cond:
                        self._cond.notify_all()
                self._stop.wait(min(1.0, self.config.heartbeat_s))
            except Exception:  # noqa: BLE001 - the watcher must outlive any one bad step
                log.exception("receiver %r: watcher step failed; retrying", self.name)
                self._stop.wait(min(1.0, self.config.heartbeat_s))
            self._kick.wait(_POLL_S if fast else _SLOW_POLL_S)  # an apply kicks it for its acknowledgement

    def _follow_versions(self, ctl: Control) -> None:
        source = self._source
        if isinstance(self._error, WeightSyncSchemaError):
            latest = ctl.get_json("latest")
            version = -1 if latest is None else int(latest["version"])
            if version > self._rejected_version:  # tell the sender, version by version
                self._rejected_version = version
                self._state.rejected(version, str(self._error))
            return
        if source is None:
            return
        # `latest` is never deleted once written: after the first sighting, a plain get.
        latest = ctl.get_json("latest") if self._latest is None else ctl.open("latest", ctl.store.get("latest"))
        if latest is not None:
            record = Published(int(latest["version"]), int(latest["epoch"]))
            if record != self._latest and (self._latest is None or record.version > self._latest.version):
                with self._cond:
                    self._latest = record
                    self._cond.notify_all()

    def _published_sums(self, version: int) -> list[int] | None:
        held = self._sums
        return held[1] if held is not None and held[0] == version else None

    def _follow_sums(self, ctl: Control) -> None:
        """With ``verify``, fetch the checksums of the newest shared version for update()."""
        latest = self._latest
        if not self.config.verify or latest is None or (self._sums is not None and self._sums[0] == latest.version):
            return
        record = ctl.get_json(f"v/{latest.version}/sums")
        if record is not None and int(record["version"]) == latest.version:
            self._sums = (latest.version, [int(s) for s in record["sums"]])
            with self._cond:
                self._cond.notify_all()

    def _follow_close(self, ctl: Control) -> None:
        source = self._source
        if source is None:
            return
        closed_key = f"closed/{source.epoch}"
        if not self._sender_closed and ctl.has(closed_key) and ctl.get_json(closed_key):
            with self._cond:
                self._sender_closed = True
                self._cond.notify_all()

    def _refuse(self, exc: WeightSyncAuthError) -> None:
        """A record failed authentication: fatal before a valid sender is known, else ignored."""
        if self._source is None:
            self._error = exc
            with self._cond:
                self._cond.notify_all()
            self._stop.set()
        if str(exc) != self._last_refusal:
            log.error("receiver %r refused a record: %s", self.name, exc)
            self._last_refusal = str(exc)

    def _follow_sender(self, ctl: Control) -> None:
        """Switch to the newest sender epoch whose records verify (a forged pointer is skipped)."""
        current_text = ctl.get_text("sender/current")
        if current_text is None:
            return
        current = int(current_text)
        floor = self._source.epoch if self._source is not None else 0
        if current <= floor:
            return
        refusal: WeightSyncAuthError | None = None
        for epoch in range(current, max(floor, current - _EPOCH_SCAN), -1):
            if epoch in self._refused_epochs:
                continue
            try:
                record = ctl.get_json(f"sender/{epoch}")
                layout_text = ctl.get_json(f"layout/{epoch}")
            except WeightSyncAuthError as exc:
                self._refused_epochs.add(epoch)
                refusal = exc
                continue
            if record is not None and layout_text is not None:
                self._switch(ctl, epoch, record, layout_text)
                return
        if refusal is not None:
            self._refuse(refusal)

    def _switch(self, ctl: Control, epoch: int, record: dict[str, object], layout_text: str) -> None:
        layout = Layout.from_json(layout_text)
        closed_key = f"closed/{epoch}"
        try:
            layout.check_module(self._tensors, self.name)
            source = self._make_source(epoch, layout, record)
        except WeightSyncSchemaError as exc:
            self._error = exc  # raised by update()/wait_for_version(); reported on each version
            log.error("%s", exc)
            with self._cond:
                self._cond.notify_all()
            return
        except OSError as exc:  # its shared segment is gone: that sender has ended
            self._refused_epochs.add(epoch)
            log.warning("receiver %r: sender epoch %d cannot be read (%s)", self.name, epoch, exc)
            if ctl.has(closed_key) and ctl.get_json(closed_key):
                with self._cond:
                    self._sender_closed = True
                    self._cond.notify_all()
            return
        with self._apply_lock:
            if self._source is not None:
                self._source.close()
            self._source = source
            self._sender_closed = False
        log.info("receiver %r follows sender epoch %d (%s)", self.name, epoch,
                 self._source.describe())  # fmt: skip

    def _make_source(self, epoch: int, layout: Layout, record: dict[str, object]) -> ReceiveSource:
        return open_source(
            epoch, layout, record, self._ordered_for(layout), host=self._host, name=self.name, swap=self.config.apply == "swap",
            net=lambda backend: NetReceiveLink(
                self._ctl, layout, epoch=epoch, rid=self.rid, backend=backend,
                addr=local_address(self._store_address), timeout_s=self.config.timeout_s,
                device=self._device if backend == "nccl" else torch.device("cpu"),
                on_staged=self._on_staged, on_rejected=self._on_rejected,
            ),
        )  # fmt: skip

    def _ordered_for(self, layout: Layout) -> list[torch.Tensor]:
        return [self._tensors[e.name] for e in layout.entries]

    def _on_staged(self, version: int) -> None:
        self._state.held(version)
        self._kick.set()  # the watcher acknowledges it now, not at its next (slow) poll
        with self._cond:
            self._cond.notify_all()

    def _on_rejected(self, version: int, reason: str) -> None:
        self.rejected += 1
        log.warning("receiver %r rejected version %d: %s", self.name, version, reason)
        self._state.rejected(version, reason)
        self._kick.set()

    # -- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        """Leave the job. The module keeps the version it holds."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._kick.set()
        self._thread.join(timeout=10)
        try:
            self._state.write(self._ctl)
            self._ctl.set_json(f"member/{self.rid}/gone", True)
        except RuntimeError:
            pass  # store already gone: the sender sees the heartbeat stop instead
        with self._apply_lock:
            if self._source is not None:
                self._source.close()
                self._source = None
        log.info("WeightReceiver %r (rid=%d) closed at version %r", self.name, self.rid, self.version)

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
