"""lightning_wsync: versioned, failure-isolated weight sync from a trainer to rollout workers."""

from typing import TYPE_CHECKING

from lightning_wsync._pull.receiver import WeightReceiver
from lightning_wsync._push.report import PushHandle, PushReport
from lightning_wsync._push.sender import WeightSender
from lightning_wsync.channel import ExperienceReader, ExperienceWriter
from lightning_wsync.config import CallbackConfig, ReceiverConfig, SenderConfig, register_configs
from lightning_wsync.engines import ApplyTarget
from lightning_wsync.errors import (
    WeightSyncAuthError,
    WeightSyncClosedError,
    WeightSyncConfigError,
    WeightSyncError,
    WeightSyncIntegrityError,
    WeightSyncRecordError,
    WeightSyncSchemaError,
    WeightSyncStoreError,
    WeightSyncTimeoutError,
)

if TYPE_CHECKING:
    from lightning_wsync.callback import WeightSyncCallback


def __getattr__(name: str) -> object:
    # torchrun imports lightning_wsync.rendezvous (hence this package) in every agent;
    # the callback pulls in Lightning, so it is imported on first use only.
    if name == "WeightSyncCallback":
        from lightning_wsync.callback import WeightSyncCallback

        return WeightSyncCallback
    raise AttributeError(f"module 'lightning_wsync' has no attribute {name!r}")

__all__ = [
    "ApplyTarget",
    "CallbackConfig",
    "ExperienceReader",
    "ExperienceWriter",
    "PushHandle",
    "PushReport",
    "ReceiverConfig",
    "SenderConfig",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncAuthError",
    "WeightSyncRecordError",
    "WeightSyncCallback",
    "WeightSyncClosedError",
    "WeightSyncConfigError",
    "WeightSyncError",
    "WeightSyncIntegrityError",
    "WeightSyncSchemaError",
    "WeightSyncStoreError",
    "WeightSyncTimeoutError",
    "register_configs",
]
