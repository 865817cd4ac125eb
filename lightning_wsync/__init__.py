"""lightning_wsync: versioned, failure-isolated weight sync from a trainer to rollout workers."""

from lightning_wsync.channel import ExperienceReader, ExperienceWriter
from lightning_wsync.config import ReceiverConfig, SenderConfig
from lightning_wsync.errors import (
    WeightSyncAuthError,
    WeightSyncClosedError,
    WeightSyncError,
    WeightSyncIntegrityError,
    WeightSyncSchemaError,
    WeightSyncStoreError,
    WeightSyncTimeoutError,
)
from lightning_wsync.receiver import WeightReceiver
from lightning_wsync.sender import PushHandle, PushReport, WeightSender

__all__ = [
    "ExperienceReader",
    "ExperienceWriter",
    "PushHandle",
    "PushReport",
    "ReceiverConfig",
    "SenderConfig",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncAuthError",
    "WeightSyncClosedError",
    "WeightSyncError",
    "WeightSyncIntegrityError",
    "WeightSyncSchemaError",
    "WeightSyncStoreError",
    "WeightSyncTimeoutError",
]
