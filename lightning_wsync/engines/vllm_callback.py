"""VllmServersCallback: vLLM servers follow a WeightSyncCallback's pushes, version by version.

::

    sync = WeightSyncCallback(every_n_steps=10, store="trainer-host:29500", job="run1")
    servers = VllmServersCallback(sync, ["http://a:8000", "http://b:8000"])
    L.Trainer(callbacks=[sync, servers]).fit(model)           # servers after sync: they see its push

After each push of ``sync`` (global rank 0), every server loads exactly that version in
all its workers or none (:func:`~lightning_wsync.engines.vllm_servers.apply_version`:
staged while requests run, then loaded and labelled while paused), so ``/weight_info``
and the per-token labels name it. The training step waits for that; push less often for
large models. A push that was dropped (receivers still copying both snapshot slots) is
skipped: the next one carries newer weights.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_wsync._control.store import resolve_job
from lightning_wsync.callback import WeightSyncCallback
from lightning_wsync.engines.lora import adapter_config
from lightning_wsync.engines.vllm_lora_servers import ServedAdapterNames
from lightning_wsync.engines.vllm_servers import VllmServers, apply_version

log = logging.getLogger(__name__)


class VllmServersCallback(pl.Callback):
    """Drives vLLM servers (``--weight-transfer-config '{"backend": "wsync"}'``) to each version ``sync`` pushes.

    Args:
        sync: the :class:`WeightSyncCallback` whose pushes the servers follow; list it first.
        urls: the servers, ``"http://host:port"``.
        timeout_s: bound on a server staging a version (and on each HTTP call, plus 30 s).
        pause_mode: ``"keep"``, ``"abort"`` or None, as :func:`apply_version`.
        server_options: :class:`~lightning_wsync.ReceiverConfig` fields for the servers'
            receivers (``verify``, ``fleet``); the secret comes from their ``$WSYNC_SECRET``.
            With ``lora`` (the adapter's config) and ``keep_adapters``, each version is an
            adapter served as ``wsync-v{N}`` (:mod:`~lightning_wsync.engines.vllm_lora_servers`).
    """

    def __init__(
        self,
        sync: WeightSyncCallback,
        urls: Sequence[str],
        *,
        timeout_s: float = 120.0,
        pause_mode: str | None = "keep",
        server_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(sync, WeightSyncCallback):
            raise TypeError(f"VllmServersCallback: sync={sync!r} must be the WeightSyncCallback whose pushes to follow")
        if server_options and "secret" in server_options:
            raise ValueError(
                "VllmServersCallback: server_options may not carry 'secret' (it would travel over HTTP); "
                "set WSYNC_SECRET in the servers' environment"
            )
        self.sync = sync
        self.servers = VllmServers(urls, timeout_s=timeout_s + 30.0)
        self.timeout_s = timeout_s
        self.pause_mode = pause_mode
        self.server_options = dict(server_options or {})
        if self.server_options.get("lora") is not None:
            self.server_options["lora"] = adapter_config(self.server_options["lora"])  # plain data, for HTTP
        self.adapters = ServedAdapterNames.from_options(self.servers, self.server_options)
        self.version: int | None = None  # the version every server holds
        self._joined = False
        self._dropped = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._follow(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._follow(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._follow(trainer)  # the final push waited for a slot: published

    def _follow(self, trainer: pl.Trainer) -> None:
        version, sender = self.sync.last_pushed_version, self.sync.sender
        if not trainer.is_global_zero or version is None or version == self.version:
            return
        if sender is not None:
            dropped, self._dropped = self._dropped, sender.dropped_pushes
            if sender.dropped_pushes != dropped:
                log.debug("VllmServersCallback: version %d was dropped by the sender; waiting for the next", version)
                return
            if not self._joined:
                job = resolve_job(self.sync.config.job, "VllmServersCallback")
                options = {"timeout_s": self.timeout_s, **self.server_options}
                init_info = {"store": sender.store_address, "job": job, "options": options}
                self.servers.init_weight_transfer_engine(init_info)
                self._joined = True
        if not self._joined:
            return
        if self.adapters is not None:
            self.adapters.apply(self.servers, version, timeout_s=self.timeout_s, pause_mode=self.pause_mode)
        else:
            apply_version(self.servers, self.servers, version, timeout_s=self.timeout_s, pause_mode=self.pause_mode)
        self.version = version
        log.debug("VllmServersCallback: servers %s at version %d", self.servers.urls, version)
