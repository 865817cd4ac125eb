"""vLLM's weight-transfer API on lightning_wsync: the ``wsync`` backend.

For code that already drives vLLM's RL API; the trainer never takes part in the call::

    llm = make_llm(model_dir, weight_transfer_config={"backend": "wsync"})
    llm.init_weight_transfer_engine({"init_info": {"store": "host:port", "job": "run1"}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {}})      # the newest verified version staged here
    llm.finish_weight_update()

Each worker's engine is a :class:`WeightReceiver` that stages and verifies versions in
the background; ``update_weights`` loads the newest staged version (with ``min_version``,
waits up to ``timeout_s`` for one at least that new) through vLLM's layer-by-layer
reload, after the same start-up name check as :class:`VllmWeightSync`. vLLM calls each
worker's ``update_weights`` on its own, so with tensor parallelism two workers can load
different versions when a push lands in between: use :class:`VllmWeightSync` (all
workers one version or none) there. The backend registers itself when this module is
imported; ``make_llm``'s worker extension imports it in every worker process.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload.inplace import reload_weights

from lightning_wsync._pull.receiver import WeightReceiver
from lightning_wsync.engines._commit import StagedVersion
from lightning_wsync.engines._vllm_names import check_names
from lightning_wsync.errors import WeightSyncSchemaError

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

    min_version: int | None = None
    timeout_s: float | None = None


class WsyncTransferEngine(WeightTransferEngine[WsyncInitInfo, WsyncUpdateInfo]):  # type: ignore[misc]
    """A worker's receiver behind vLLM's ``start/update/finish_weight_update``."""

    init_info_cls = WsyncInitInfo
    update_info_cls = WsyncUpdateInfo
    supports_draft_weight_update = False

    receiver: WeightReceiver | None = None
    version: int | None = None  # the version loaded into the model

    def init_transfer_engine(self, init_info: WsyncInitInfo) -> None:
        if self.receiver is not None:
            self.receiver.close()
        rank = self.parallel_config.rank
        self.staged = StagedVersion()
        name = f"{init_info.name or f'vllm-{os.getpid()}'}-w{rank}"
        self.receiver = WeightReceiver(self.staged, init_info.store, init_info.job, name=name, **init_info.options)

    def start_weight_update(self) -> None:
        pass  # the reload runs whole inside receive_weights

    def receive_weights(self, update_info: WsyncUpdateInfo) -> None:
        receiver = self.receiver
        if receiver is None:
            raise RuntimeError("wsync weight transfer: call init_weight_transfer_engine({'init_info': {...}}) first")
        if update_info.min_version is None:
            receiver.update()
        else:
            receiver.wait_for_version(update_info.min_version, update_info.timeout_s)
        staged = self.staged.version
        if staged is None or staged == self.version:
            return
        refused, _ = check_names(self.vllm_config, self.staged.tensors.items())
        if refused:
            raise WeightSyncSchemaError(
                f"wsync weight transfer {receiver.name!r}: the trainer's tensors {refused!r} would not load "
                f"into the engine's model; publish the checkpoint's names, or exclude=[...] them"
            )
        self.version = None
        reload_weights(self.vllm_config, self.model, iter(self.staged.tensors.items()), None, True)
        self.version = staged
        log.debug("wsync weight transfer %r loaded version %d", receiver.name, staged)

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        receiver, self.receiver = self.receiver, None
        if receiver is not None:
            receiver.close()


def register() -> None:
    """Register the ``wsync`` backend with vLLM's factory in this process (idempotent)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, WsyncTransferEngine)


register()
