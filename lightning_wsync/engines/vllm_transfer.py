"""vLLM's weight-transfer API on lightning_wsync: the ``wsync`` worker engine.

A vLLM server needs no code of ours: the ``vllm.general_plugins`` entry point registers
the backend in every vLLM process (:mod:`~lightning_wsync.engines._vllm_plugin`)::

    VLLM_SERVER_DEV_MODE=1 WSYNC_SECRET=... python -m vllm.entrypoints.openai.api_server \
        --model MODEL --weight-transfer-config '{"backend": "wsync"}'

and a trainer drives it through vLLM's own trainer API
(:class:`~lightning_wsync.engines.vllm_trainer.WsyncTrainerEngine`), or any code through
the RL routes / ``LLM`` methods::

    llm.init_weight_transfer_engine({"init_info": {"store": "host:port", "job": "run1"}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 7}})   # exactly 7, in every worker, or none
    llm.finish_weight_update(weight_version="7")

Each worker's engine is a :class:`WeightReceiver` that stages and verifies versions in
the background. ``update_weights`` with ``version`` stages exactly that version (waiting
up to ``timeout_s``), checks the names against the model, then the workers of the engine
agree over vLLM's own CPU process group (all stage it, or all refuse before any model is
written) and load it through vLLM's layer-by-layer reload. Without ``version`` it loads
the newest staged version (``min_version``: one at least that new), each worker on its
own: with tensor parallelism pass ``version``. Store, job and secret come from the init
info or from ``WSYNC_STORE``, ``WSYNC_JOB``, ``WSYNC_SECRET`` in the server's environment.
With ``WSYNC_FOLLOW=1`` there too, the server follows the trainer with no client calling
these routes (:mod:`~lightning_wsync.engines._worker.follow`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload.inplace import reload_weights

from lightning_wsync._pull.receiver import WeightReceiver
from lightning_wsync.engines._worker.commit import StagedVersion
from lightning_wsync.engines._worker.follow import Follower, follow_settings
from lightning_wsync.engines._worker.names import check_names
from lightning_wsync.engines._worker.served import ServedAdapters
from lightning_wsync.engines.lora import adapter_config
from lightning_wsync.errors import WeightSyncError, WeightSyncSchemaError

log = logging.getLogger(__name__)

BACKEND = "wsync"


@dataclass
class WsyncInitInfo(WeightTransferInitInfo):  # type: ignore[misc]  # vLLM is untyped where mypy runs
    """``init_info`` of ``init_weight_transfer_engine``: where the job is, and receiver options."""

    store: str | None = None
    job: str | None = None
    name: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # ReceiverConfig fields (timeout_s, verify, ...)


@dataclass
class WsyncUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """``update_info`` of ``update_weights``: empty for the newest staged version."""

    version: int | None = None  # exactly this version, in every worker of the engine or none
    stage_only: bool = False  # with version: stage and agree, load nothing (the load follows, paused)
    min_version: int | None = None
    timeout_s: float | None = None


class WsyncTransferEngine(WeightTransferEngine[WsyncInitInfo, WsyncUpdateInfo]):  # type: ignore[misc]
    """A worker's receiver behind vLLM's ``start/update/finish_weight_update``."""

    init_info_cls = WsyncInitInfo
    update_info_cls = WsyncUpdateInfo
    supports_draft_weight_update = False

    receiver: WeightReceiver | None = None
    version: int | None = None  # the version loaded into the model
    follower: Follower | None = None  # with WSYNC_FOLLOW: the server applies new versions itself
    adapters: ServedAdapters | None = None  # with options {"lora": ...}: versions are adapters, the base stays

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = follow_settings()
        if settings is not None:
            self.follower = Follower(self, settings, drive=self.parallel_config.rank == 0)

    def init_transfer_engine(self, init_info: WsyncInitInfo) -> None:
        if self.receiver is not None:
            self.receiver.close()
        rank = self.parallel_config.rank
        self.staged = StagedVersion()
        name = f"{init_info.name or f'vllm-{os.getpid()}'}-w{rank}"
        options = dict(init_info.options)
        lora, keep = options.pop("lora", None), options.pop("keep_adapters", None)
        if self.adapters is not None:
            self.adapters.close()
            self.adapters = None
        if lora is not None:
            self.adapters = ServedAdapters(self.vllm_config, self.model, adapter_config(lora), keep)
            self.adapters.serve()
        self.receiver = WeightReceiver(self.staged, init_info.store, init_info.job, name=name, **options)

    def join_job(self, name: str | None, options: dict[str, Any]) -> None:
        """Start this worker's receiver with store and job from the environment (for the follower)."""
        self.init_transfer_engine(WsyncInitInfo(name=name, options=options))

    def start_weight_update(self) -> None:
        pass  # the reload runs whole inside receive_weights

    def receive_weights(self, update_info: WsyncUpdateInfo) -> None:
        receiver = self.receiver
        if receiver is None:
            raise WeightSyncError(
                "wsync weight transfer: call init_weight_transfer_engine({'init_info': {...}}) first "
                "(the trainer engine does; store and job may come from WSYNC_STORE / WSYNC_JOB)"
            )
        if update_info.version is not None:
            self._load_exactly(receiver, update_info.version, update_info.timeout_s, update_info.stage_only)
            return
        if update_info.min_version is None:
            receiver.update()
        else:
            receiver.wait_for_version(update_info.min_version, update_info.timeout_s)
        staged = self.staged.version
        if staged is None or staged == self.version:
            return
        self._check_names(receiver.name)
        self._reload(receiver.name, staged)

    def _load_exactly(self, receiver: WeightReceiver, version: int, timeout_s: float | None, stage_only: bool) -> None:
        """Stage ``version`` here; load it only once every worker of the engine has staged it."""
        problem = None
        try:
            if self.staged.version != version:
                receiver.wait_for_version(version, timeout_s)
            if self.staged.version != version:
                raise WeightSyncError(
                    f"wsync weight transfer {receiver.name!r}: asked for version {version} but version "
                    f"{self.staged.version!r} is the newest staged (a newer push overtook it); ask for that one"
                )
            self._check_names(receiver.name)
        except WeightSyncError as exc:
            problem = exc
        if not _all_workers_agree(problem is None):  # every worker takes part, so none waits for another
            if problem is not None:
                raise problem
            raise WeightSyncError(
                f"wsync weight transfer {receiver.name!r}: another worker of the engine could not stage "
                f"version {version}; no worker loaded it (the engine keeps version {self.version!r})"
            )
        if version != self.version and not stage_only:
            self._reload(receiver.name, version)

    def _check_names(self, name: str) -> None:
        if self.adapters is not None:
            refused = self.adapters.refused(self.staged.tensors)
        else:
            refused, _ = check_names(self.vllm_config, self.staged.tensors.items())
        if refused:
            raise WeightSyncSchemaError(
                f"wsync weight transfer {name!r}: the trainer's tensors {refused!r} would not load "
                f"into the engine's {'LoRA layers' if self.adapters else 'model'}; publish the checkpoint's names, "
                f"or exclude=[...] them"
            )

    def _reload(self, name: str, version: int) -> None:
        self.version = None  # until the reload returns, the model may hold parts of two versions
        if self.adapters is not None:  # loadable by name from now on: /v1/load_lora_adapter wsync:v{version}
            self.adapters.add(version, self.staged.tensors)
        else:
            reload_weights(self.vllm_config, self.model, iter(self.staged.tensors.items()), None, True)
        self.version = version
        log.debug("wsync weight transfer %r loaded version %d", name, version)

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        follower, self.follower = self.follower, None
        if follower is not None:
            follower.close()
        adapters, self.adapters = self.adapters, None
        if adapters is not None:
            adapters.close()
        receiver, self.receiver = self.receiver, None
        if receiver is not None:
            receiver.close()


def _all_workers_agree(ok: bool) -> bool:
    """True when every worker of this engine (all TP/PP ranks) says ``ok``: a MIN over vLLM's
    CPU world group. vLLM calls ``update_weights`` in every worker, so all reach it."""
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    if group.world_size == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
    return bool(flag.item())


def register() -> None:
    """Register the ``wsync`` backend with vLLM's factory in this process (idempotent)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, WsyncTransferEngine)


register()
