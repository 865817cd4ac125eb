"""Configuration of each component: one dataclass each, validated at construction.

The same fields are the components' keyword arguments, so they work without Hydra::

    WeightSender(model, store="127.0.0.1:29400", job="exp1", dtype="bfloat16", bucket_mb=32)

and as Hydra structured configs (see :func:`register_configs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TRANSPORTS = ("auto", "shm", "gloo", "nccl")
WIRE_DTYPES = ("float32", "bfloat16", "float16")


def _positive(owner: str, name: str, value: float, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{owner}: {name}={value!r} must be a number > 0; {fix}")


def _patterns(owner: str, name: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(p, str) for p in value):  # type: ignore[attr-defined]
        raise TypeError(f"{owner}: {name}={value!r} must be a list of glob patterns, e.g. ['*lora_*']")
    return tuple(value)  # type: ignore[arg-type]


@dataclass(kw_only=True)
class SenderConfig:
    """Settings of :class:`~lightning_wsync.WeightSender`.

    Attributes:
        job: namespace on the store (default ``$WSYNC_JOB``).
        dtype: cast floating tensors to this dtype on the wire (``"bfloat16"`` halves the
            bytes); receivers cast back into their own dtype. None sends as is.
        include: glob patterns of tensor names to send (default: all).
        exclude: glob patterns of tensor names to leave out.
        bucket_mb: size of the network send unit and checksum granularity, in MiB.
        timeout_s: bound on every wait for a receiver (acknowledgement, group set-up, send).
        transport: ``"auto"`` (shared memory for receivers on this host, gloo/NCCL for the
            rest), ``"shm"``, ``"gloo"`` or ``"nccl"``.
        heartbeat_timeout_s: a receiver silent this long is treated as gone.
    """

    job: str | None = None
    dtype: str | None = None
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    bucket_mb: float = 32.0
    timeout_s: float = 30.0
    transport: str = "auto"
    heartbeat_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        owner = "WeightSender"
        if self.dtype is not None and self.dtype.removeprefix("torch.") not in WIRE_DTYPES:
            raise ValueError(f"{owner}: dtype={self.dtype!r} is not supported; choose one of {WIRE_DTYPES} or None")
        _patterns(owner, "include", self.include)
        _patterns(owner, "exclude", self.exclude)
        _positive(owner, "bucket_mb", self.bucket_mb, "e.g. bucket_mb=32")
        _positive(owner, "timeout_s", self.timeout_s, "e.g. timeout_s=30")
        _positive(owner, "heartbeat_timeout_s", self.heartbeat_timeout_s, "e.g. heartbeat_timeout_s=10")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"{owner}: transport={self.transport!r} is unknown; choose one of {TRANSPORTS}")

    @property
    def wire_dtype(self) -> torch.dtype | None:
        if self.dtype is None:
            return None
        dtype: torch.dtype = getattr(torch, self.dtype.removeprefix("torch."))
        return dtype

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))


@dataclass(kw_only=True)
class ReceiverConfig:
    """Settings of :class:`~lightning_wsync.WeightReceiver`.

    Attributes:
        job: namespace on the store (default ``$WSYNC_JOB``).
        name: how this receiver appears in push reports (default: role and rank under
            torchrun, else host and pid).
        include: glob patterns of tensor names to receive (must match the sender's).
        exclude: glob patterns of tensor names to leave out (must match the sender's).
        timeout_s: bound on connecting to the store and on each network receive.
        heartbeat_s: interval of the liveness signal the sender watches.
    """

    job: str | None = None
    name: str | None = None
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    timeout_s: float = 30.0
    heartbeat_s: float = 0.5

    def __post_init__(self) -> None:
        owner = "WeightReceiver"
        _patterns(owner, "include", self.include)
        _patterns(owner, "exclude", self.exclude)
        _positive(owner, "timeout_s", self.timeout_s, "e.g. timeout_s=30")
        _positive(owner, "heartbeat_s", self.heartbeat_s, "e.g. heartbeat_s=0.5")
        if self.name is not None and (not self.name or "/" in self.name):
            raise ValueError(f"{owner}: name={self.name!r} must be non-empty and contain no '/'")
