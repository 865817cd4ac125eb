"""WeightReceiver: keep a rollout module at the newest complete version, applied on request.

::

    policy = Policy()
    with WeightReceiver(policy) as receiver:            # store and job from WSYNC_* env
        receiver.wait_for_version(0, timeout_s=60)      # the initial weights
        while True:
            run_rollout(policy)
            receiver.update()                           # newest complete version, if newer

A background thread (:mod:`~lightning_wsync._pull.watcher`) sends heartbeats and
acknowledgements and follows the sender. From a sender on this host, ``update()`` pins
the newest complete slot of the shared snapshot ring and copies it straight into the
module; from a sender on another host, through the host's relay leader by default (which receives
and verifies each version into the host's ring) or, with ``cross_host="star"``, a link of its own
that stages and verifies it (:mod:`~lightning_wsync._planes.open`). Either way the module is only
ever written by ``update()`` on the caller's thread, and only with a complete version.
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType

import torch
import torch.distributed as dist
from torch import nn

from lightning_wsync._control import keys
from lightning_wsync._control.fleet_records import FleetSwitch
from lightning_wsync._control.host import default_receiver_name, host_id
from lightning_wsync._control.manifest import Manifest, select_tensors
from lightning_wsync._control.records import ManifestRecord, SenderPointer
from lightning_wsync._control.signing import resolve_secret
from lightning_wsync._control.store import Control, connect_store, resolve_job
from lightning_wsync._pull.fleet import FleetMember
from lightning_wsync._pull.loan import SharedLender
from lightning_wsync._pull.target import ApplyTarget, TargetTensors
from lightning_wsync._pull.target import CopyInto as _CopyInto
from lightning_wsync._pull.watcher import Watcher
from lightning_wsync.config import ReceiverConfig, config_values
from lightning_wsync.errors import (
    WeightSyncClosedError,
    WeightSyncError,
    WeightSyncIntegrityError,
    WeightSyncStoreError,
    WeightSyncTimeoutError,
)

log = logging.getLogger(__name__)

class WeightReceiver:
    """Receives the versions a :class:`WeightSender` publishes into ``module``.

    Args:
        module: the rollout module, whose parameters and buffers are updated in place;
            or an :class:`~lightning_wsync.engines.ApplyTarget` (e.g. an inference
            engine's loader), handed each complete, verified version by ``update()``.
        store: a ``torch.distributed.Store`` or ``"host:port"`` (always joined as a
            client). Default ``$WSYNC_STORE``.
        job: the job's name on the store (default ``$WSYNC_JOB``); overrides ``config.job``.
        config: a :class:`ReceiverConfig`; or pass its fields (``name``, ``verify``, ...)
            as keyword ``options``, not both.
    """

    def __init__(
        self,
        module: nn.Module | ApplyTarget,
        store: dist.Store | str | None = None,
        job: str | None = None,
        *,
        config: ReceiverConfig | None = None,
        **options: object,
    ) -> None:
        cfg = ReceiverConfig(**config_values(ReceiverConfig, config, options, owner="WeightReceiver", job=job))
        self.config = cfg
        self._target: TargetTensors | None = None
        self._module = isinstance(module, nn.Module)
        if isinstance(module, nn.Module):
            self._tensors = select_tensors(module, cfg.include, cfg.exclude)
            if cfg.fleet is not None:  # versions are staged privately, applied when the fleet switches
                self._target = TargetTensors(_CopyInto(self._tensors), cfg.include, cfg.exclude)
        elif callable(module):
            self._target = TargetTensors(module, cfg.include, cfg.exclude)
            self._tensors = {}  # allocated from the sender's layout when it is known
        else:
            raise TypeError(
                f"WeightReceiver: module={module!r} is neither an nn.Module nor a callable "
                f"ApplyTarget (tensors, version); pass the rollout module or a loader function"
            )
        job_name = resolve_job(cfg.job, "WeightReceiver")
        key = resolve_secret(cfg.secret, "WeightReceiver")
        handle = connect_store(store, serve=False, timeout_s=cfg.timeout_s, owner="WeightReceiver")
        self._store_address = handle.address
        self._ctl = Control(handle.store, job_name, key)
        self._device = next(iter(self._tensors.values())).device if self._tensors else torch.device("cpu")
        self.version: int | None = None
        self._closed = False
        self._apply_lock = threading.Lock()
        self.name = cfg.name or default_receiver_name()
        self._watcher = Watcher(
            self._ctl, cfg, name=self.name, host=host_id(), store_address=handle.address, device=self._device,
            bind=self._bind, apply_lock=self._apply_lock,
        )  # fmt: skip
        self._fleet: FleetMember | None = None
        if cfg.fleet is not None:
            self._fleet = FleetMember(self._ctl, cfg.fleet, self._watcher, self._apply_lock, verify=cfg.verify)
        log.info("WeightReceiver %r (rid=%d) joined job %r", self.name, self.rid, job_name)

    @property
    def rid(self) -> int:
        """This receiver's id in the job (a new one if the sender forgot it while it was silent)."""
        return self._watcher.rid

    @property
    def rejected(self) -> int:
        """Versions refused on verification (checksum or signature)."""
        return self._watcher.rejected

    def _bind(self, layout: Manifest) -> list[torch.Tensor]:
        """The tensors a sender's versions are written into, in its layout's order."""
        if self._target is None:
            layout.check_module(self._tensors, self.name)
            return [self._tensors[e.name] for e in layout.entries]
        staged = self._target.tensors_for(layout)
        if not self._module:
            self._tensors = staged
        layout.check_module(self._tensors, self.name)
        return [staged[e.name] for e in layout.entries]

    # -- user API -----------------------------------------------------------------
    def update(self) -> int | None:
        """Apply the newest complete version if it is newer than the one held.

        Never waits on the network or on the sender: it copies a pinned shared-memory
        slot or a version already staged. Returns the version applied, or None. After it
        returns or raises, the module holds one complete version and :attr:`version` names
        it (None only after a :class:`WeightSyncIntegrityError`).
        """
        self._raise_if_unusable()
        watcher = self._watcher
        with self._apply_lock:
            source = watcher.source
            if self._fleet is not None:
                applied = self._fleet.take(self.version)  # only a version its fleet switched to
            elif source is None:
                return None
            else:
                try:
                    applied = source.apply(
                        self.version, watcher.published_sums if self.config.verify else None, watcher.on_rejected
                    )
                except WeightSyncIntegrityError:
                    self.version = None  # the module may hold a torn copy now; say so
                    raise
            if applied is not None and self._target is not None:
                self._hand_over(applied)
            if applied is not None and self._fleet is not None:
                self._fleet.did_apply(applied, lent=not self._module)
        if applied is not None:
            self.version = applied
            watcher.held(applied)
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
            if self._watcher.sender_closed and not self._watcher.newer_pending(self.version):
                raise WeightSyncClosedError(
                    f"WeightReceiver {self.name!r}: the sender of job {self._ctl.job!r} closed; the newest "
                    f"version held is {self.version!r}, below min_version={min_version!r}"
                )
            lost = self._watcher.store_lost_since
            if lost is not None and time.monotonic() - lost >= timeout_s:
                raise WeightSyncStoreError(
                    f"WeightReceiver {self.name!r}: the control-plane store {self._store_address!r} has been "
                    f"unreachable for {time.monotonic() - lost:.1f} s; the module keeps version {self.version!r}. "
                    f"The trainer (or `lightning-wsync store`) is gone: restart it, or exit and let torchrun "
                    f"restart this worker"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                latest = self.latest_published
                raise WeightSyncTimeoutError(
                    f"WeightReceiver {self.name!r}: no version >= {min_version!r} within timeout_s={timeout_s} "
                    f"(held {self.version!r}, newest published {latest!r}, job {self._ctl.job!r} on store "
                    f"{self._store_address!r}); is the trainer pushing? raise timeout_s otherwise"
                )
            until = time.monotonic() + min(remaining, self._watcher.timing.wait_poll_s)
            if self._fleet is not None:
                self._fleet.wait_for_news(until)  # a switch, not a new version, is news here
            else:
                self._watcher.wait_for_news(until)

    @property
    def latest_published(self) -> int | None:
        """Newest version the sender has published (as last seen on the store)."""
        latest = self._watcher.latest
        return None if latest is None else latest.version

    def published_tensors(self) -> dict[str, torch.Tensor] | None:
        """The tensors the job's current sender publishes (those ``include``/``exclude`` select),
        as meta tensors of their wire shape and dtype; None when no sender's layout is on the store.

        For checks before the first version (an engine's names). Reads the store.
        """
        pointer = self._ctl.get_record(keys.SENDER_CURRENT, SenderPointer)
        record = None if pointer is None else self._ctl.get_record(keys.manifest(pointer.epoch), ManifestRecord)
        if record is None:
            return None
        pick = TargetTensors(lambda tensors, version: None, self.config.include, self.config.exclude)
        return {
            e.name: torch.empty(e.shape, dtype=e.wire_dtype, device="meta")
            for e in record.layout.entries
            if pick.selects(e.name)
        }

    def shared_lender(self) -> SharedLender:
        """Lends versions straight out of this host's shared memory (an engine's loader reads
        the pinned slot itself): :mod:`~lightning_wsync._pull.loan`. Apply targets only."""
        assert self._target is not None and not self._module and self._fleet is None
        return SharedLender(self._watcher, self._apply_lock, self._target.selects, self.config.verify, self.name)

    @property
    def fleet_switches(self) -> tuple[FleetSwitch, ...]:
        """With ``fleet``: the group's newest few switches as last seen (version, ``at`` on the
        sender's clock, the rids that switched, who was left out and why); else ()."""
        return () if self._fleet is None else self._fleet.switches

    @property
    def sender_closed(self) -> bool:
        """Training finished: the sender closed for good (a completed ``fit()`` or
        ``close(final=True)``). Leave the rollout loop once ``update()`` returns None."""
        return self._watcher.sender_closed

    @property
    def sender_left(self) -> bool:
        """The sender went away without finishing (an exception in ``fit()``, SIGTERM, a
        relaunch); training may go on. The next sender of the job is followed as soon as
        it starts, with higher versions, and this turns False again."""
        return self._watcher.sender_left

    @property
    def store_lost_s(self) -> float | None:
        """Seconds since the store became unreachable, or None while it answers."""
        lost = self._watcher.store_lost_since
        return None if lost is None else time.monotonic() - lost

    # -- applying -------------------------------------------------------------------
    def _hand_over(self, version: int) -> None:
        assert self._target is not None
        try:
            self._target.hand_over(version)
        except Exception as exc:
            held, self.version = self.version, None  # the target may hold part of a version
            raise WeightSyncError(
                f"WeightReceiver {self.name!r}: the apply target raised on version {version!r} "
                f"({type(exc).__name__}: {exc}); it held {held!r} before and may now hold part of "
                f"{version!r}, so version is None until the next update() hands over the newest again"
            ) from exc

    def _raise_if_unusable(self) -> None:
        if self._closed:
            raise WeightSyncClosedError(f"WeightReceiver {self.name!r} is closed; create a new one")
        if self._watcher.error is not None:
            raise self._watcher.error

    # -- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        """Leave the job. The module keeps the version it holds."""
        if self._closed:
            return
        self._closed = True
        if self._fleet is not None:
            self._fleet.close()
        self._watcher.close()
        log.info("WeightReceiver %r (rid=%d) closed at version %r", self.name, self.rid, self.version)

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
