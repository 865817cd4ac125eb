"""Configuration of each component: one dataclass each, validated at construction.

Longer than 300 lines: every component's settings and their docstrings, declared once, side by side.

The same fields are the components' keyword arguments, so they work without Hydra::

    WeightSender(model, store="127.0.0.1:29400", job="exp1", dtype="bfloat16", bucket_mb=32)

and as Hydra structured configs (see :func:`register_configs`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from omegaconf import MISSING

TRANSPORTS = ("auto", "shm", "gloo", "nccl", "nixl")  # nixl: hook (the NIXL plane, docs/nixl.md)
CROSS_HOST = ("relay", "chain", "tree", "star")
WIRE_DTYPES = ("float32", "bfloat16", "float16")
DELTA_MODES = ("auto", "off", "always")


def _positive(owner: str, name: str, value: float, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{owner}: {name}={value!r} must be a number > 0; {fix}")


def _patterns(owner: str, name: str, value: object) -> None:
    if isinstance(value, str) or not isinstance(value, Iterable) or not all(isinstance(p, str) for p in value):
        raise TypeError(f"{owner}: {name}={value!r} must be a list of glob patterns, e.g. ['*lora_*']")


def _delta_mode(owner: str, value: object) -> None:
    if value not in DELTA_MODES:
        raise ValueError(
            f"{owner}: delta={value!r} must be one of {list(DELTA_MODES)}; 'auto' sends only the changed "
            f"elements when that is clearly smaller than the full version, 'off' always sends full versions"
        )


def config_values(
    config_type: type[object],
    config: object | None,
    options: Mapping[str, object],
    *,
    owner: str,
    param: str = "config",
    job: str | None = None,
) -> dict[str, Any]:
    """Field values for a new ``config_type``: those of ``config``, or the keyword ``options``.

    The one "config or options" rule of every component. ``options`` holds only the
    keyword arguments the caller passed, so an option passed with its default value
    beside ``config`` is refused like any other: one of the two would be ignored.
    ``job``, when given, overrides the job of either.
    """
    names = [f.name for f in dataclasses.fields(config_type)]  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise TypeError(f"{owner}: unexpected keyword argument {unknown[0]!r}; the options are {names}")
    if config is None:
        values = dict(options)
    elif not isinstance(config, config_type):
        raise TypeError(f"{owner}: {param}={_no_secrets(config)} must be a {config_type.__name__}")
    elif options:
        raise TypeError(
            f"{owner}: got {param}={config_type.__name__}(...) and the options {sorted(options)}; "
            f"pass one or the other"
        )
    else:
        values = {name: getattr(config, name) for name in names}
    if job is not None:
        values["job"] = job
    # Sequences become fresh lists: the config must not share a caller's list.
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in values.items()}


def _no_secrets(value: object) -> str:
    """``value!r`` for an error message, but never a mapping's values (one may be the secret)."""
    shown = f"<{type(value).__name__} with keys {sorted(map(str, value))}>" if isinstance(value, Mapping) else None
    text = shown or repr(value)
    return text[:80] + ("..." if len(text) > 80 else "")


@dataclass(kw_only=True)
class _PeerConfig:
    """The fields both ends of a job have; each end's docstring says what they mean there."""

    OWNER: ClassVar[str] = "lightning_wsync"  # named in error messages

    job: str | None = None
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    timeout_s: float = 30.0
    secret: str | None = field(default=None, repr=False)  # never in a log line

    def __post_init__(self) -> None:
        if self.secret is not None and (not isinstance(self.secret, str) or not self.secret):  # never shown
            raise ValueError(f"{self.OWNER}: secret must be a non-empty string; leave it None to use $WSYNC_SECRET")
        _patterns(self.OWNER, "include", self.include)
        _patterns(self.OWNER, "exclude", self.exclude)
        _positive(self.OWNER, "timeout_s", self.timeout_s, "e.g. timeout_s=30")


@dataclass(kw_only=True)
class SenderConfig(_PeerConfig):
    """Settings of :class:`~lightning_wsync.WeightSender`.

    Attributes:
        job: namespace on the store (default ``$WSYNC_JOB``).
        dtype: cast floating tensors to this dtype on the wire (``"bfloat16"`` halves the
            bytes); receivers cast back into their own dtype. None sends as is.
        include: glob patterns of tensor names to send (default: all).
        exclude: glob patterns of tensor names to leave out.
        bucket_mb: size of the network send unit and checksum granularity, in MiB.
        timeout_s: bound on every wait for a receiver (acknowledgement, group set-up, send).
        transport: ``"auto"`` (shared memory for receivers on this host, gloo for the
            rest; CUDA weights are snapshotted to host memory), ``"shm"``, ``"gloo"``, or
            ``"nccl"`` (snapshot stays on the GPU; receivers on other GPUs get it over NCCL),
            or ``"nixl"`` (receivers on other hosts READ the snapshot ring one-sided through
            NIXL, the ``[nixl]`` extra; same-host receivers use shared memory). With ``"auto"``
            and ``cross_host="star"``, NIXL is used where installed and usable (docs/nixl.md).
        heartbeat_timeout_s: a receiver silent this long is treated as gone.
        cross_host: with ``transport="auto"``, how receivers on other hosts get a version:
            ``"relay"`` (one copy per host, to an elected leader, relayed down a chain of
            leaders, or two binary trees each carrying half when the push-time model prefers
            them; either shape carries deltas per ``delta``), ``"chain"``/``"tree"``
            (that shape always) or ``"star"`` (one copy per receiver).
        secret: shared secret (default ``$WSYNC_SECRET``): control records are HMAC-signed
            and peers without it are refused. See the README's trust model.
        delta: network path only. ``"auto"`` sends a receiver that holds the previous
            version only the changed elements (lossless, verified against the full
            version's checksums) while that is clearly smaller than the full version;
            ``"off"`` always sends full versions; ``"always"`` sends a delta whenever the
            receiver holds the base (for tests). Receivers without the base get a full version.
        cuda_ipc: with the module on a GPU, also keep the snapshot slots on that GPU and let
            same-host receivers whose modules are on a GPU copy from there by CUDA IPC (device
            to device) instead of from host memory. Costs two copies of the pushed bytes in
            the trainer GPU's memory. Where NIXL serves other hosts (``transport='nixl'``, or
            ``'auto'`` with ``cross_host='star'``), the mirror is lent to NIXL readers too, and
            a reader whose module is on a GPU READs from it (docs/nixl.md). Other receivers are
            served as without it.
    """

    OWNER: ClassVar[str] = "WeightSender"

    dtype: str | None = None
    bucket_mb: float = 32.0
    transport: str = "auto"
    heartbeat_timeout_s: float = 10.0
    cross_host: str = "relay"
    delta: str = "auto"
    cuda_ipc: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = self.OWNER
        _delta_mode(owner, self.delta)
        if self.cuda_ipc and self.transport not in ("auto", "shm", "nixl"):
            raise ValueError(
                f"{owner}: cuda_ipc=True serves same-host receivers beside the shared-memory ring, but "
                f"transport={self.transport!r}; use transport='auto', 'shm' or 'nixl', or cuda_ipc=False"
            )
        if self.dtype is not None and self.dtype.removeprefix("torch.") not in WIRE_DTYPES:
            raise ValueError(f"{owner}: dtype={self.dtype!r} is not supported; choose one of {WIRE_DTYPES} or None")
        _positive(owner, "bucket_mb", self.bucket_mb, "e.g. bucket_mb=32")
        _positive(owner, "heartbeat_timeout_s", self.heartbeat_timeout_s, "e.g. heartbeat_timeout_s=10")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"{owner}: transport={self.transport!r} is unknown; choose one of {TRANSPORTS}")
        if self.cross_host not in CROSS_HOST:
            raise ValueError(
                f"{owner}: cross_host={self.cross_host!r} is unknown; choose one of {CROSS_HOST} "
                f"('relay' picks a chain or trees of host leaders; 'star' sends from the trainer to each)"
            )

    @property
    def wire_dtype(self) -> torch.dtype | None:
        if self.dtype is None:
            return None
        dtype: torch.dtype = getattr(torch, self.dtype.removeprefix("torch."))
        return dtype

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))


APPLY_MODES = ("copy", "swap")
_FLEET_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(kw_only=True)
class ReceiverConfig(_PeerConfig):
    """Settings of :class:`~lightning_wsync.WeightReceiver`.

    Attributes:
        job: namespace on the store (default ``$WSYNC_JOB``).
        name: how this receiver appears in push reports (default: role and rank under
            torchrun, else host and pid).
        include: glob patterns of tensor names to receive (must match the sender's).
        exclude: glob patterns of tensor names to leave out (must match the sender's).
        timeout_s: bound on connecting to the store and on each network receive.
        heartbeat_s: interval of the liveness signal the sender watches.
        secret: shared secret (default ``$WSYNC_SECRET``); must equal the sender's.
        verify: on the shared-memory path too, check every bucket's xxh3 checksum (published
            by the sender) before applying; costs one extra read of the bytes. The network
            path always verifies.
        apply: how a version reaches the module from the network path. ``"copy"`` (default)
            writes into the module's own tensors, so references to them (shared memory,
            CUDA graphs, data pointers) stay valid. ``"swap"`` points each tensor at the
            verified staging buffer instead (``tensor.data = ...``) and receives the next
            version into the buffer it held before: one full copy less per version, same
            memory; it needs every tensor in the wire dtype on the link's device. The
            shared-memory path always copies (its one copy is the private one).
        fleet: a group name (opt-in): every receiver of the job with the same ``fleet``
            switches to the same version. A version is applied only once every live
            member of the group has staged it (received and verified, into a private copy
            of the weights); a member that cannot stage it within the sender's
            ``timeout_s`` is left out of that version and named in push reports, and
            joins again at a later one. None (default): apply the newest version.
    """

    OWNER: ClassVar[str] = "WeightReceiver"

    name: str | None = None
    heartbeat_s: float = 0.5
    verify: bool = False
    apply: str = "copy"
    fleet: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = self.OWNER
        _positive(owner, "heartbeat_s", self.heartbeat_s, "e.g. heartbeat_s=0.5")
        if not isinstance(self.verify, bool):
            raise TypeError(f"{owner}: verify={self.verify!r} must be True or False")
        if self.apply not in APPLY_MODES:
            raise ValueError(f"{owner}: apply={self.apply!r} must be one of {APPLY_MODES} (default 'copy')")
        if self.name is not None and (not self.name or "/" in self.name):
            raise ValueError(f"{owner}: name={self.name!r} must be non-empty and contain no '/'")
        if self.fleet is not None and (not isinstance(self.fleet, str) or not _FLEET_NAME.fullmatch(self.fleet)):
            raise ValueError(
                f"{owner}: fleet={self.fleet!r} must be a group name of letters, digits, '.', '_' or '-' "
                f"(e.g. fleet='rollout'), or None to apply the newest version on its own"
            )


@dataclass(kw_only=True)
class CallbackConfig(SenderConfig):
    """Settings of :class:`~lightning_wsync.callback.WeightSyncCallback`, as a Hydra node.

    The callback's own fields plus every :class:`SenderConfig` field (inherited, so a
    sender option is declared once and ``wsync.dtype=bfloat16`` overrides it). The fields
    are the callback's keyword arguments; ``_target_`` lets
    ``hydra.utils.instantiate(cfg.wsync)`` build the callback::

        # conf/trainer.yaml
        defaults:
          - wsync: callback       # stored by register_configs()
          - _self_
        wsync:
          every_n_steps: 10
          module: policy

    Attributes:
        every_n_steps: push every this many optimizer steps (``trainer.global_step``).
        module: attribute path of the submodule to send (``"policy"``,
            ``"model.policy"``); None sends the whole LightningModule.
        store: ``"host:port"`` of the control-plane store (default ``$WSYNC_STORE``).
        max_version_lag: when set, after each push the trainer waits (at most
            ``timeout_s``) until every live receiver holds one of the last
            ``max_version_lag`` versions pushed before it (0: the one just pushed).
        sharded: ``"auto"`` (default): with several trainer ranks under DDP or FSDP2, every
            rank snapshots its own share (~1/world of the bytes) into shared memory, with no
            gather; other hosts get each rank's share relayed on its own (a chain or trees, as
            ``cross_host``). Off, said once in the log, for one rank, ``FSDPStrategy``, a tensor
            placement it cannot split, ``transport`` other than ``"auto"``/``"shm"`` and
            ``cross_host="star"``.
            ``True`` forces it (an error where it cannot), ``False`` keeps rank 0 sending
            everything (see docs/sharded.md).

    The sender's fields are as in :class:`SenderConfig`. Leave ``secret`` unset in YAML
    (Hydra writes configs to its output folder) and set ``$WSYNC_SECRET`` instead.
    """

    OWNER: ClassVar[str] = "WeightSyncCallback"

    _target_: str = "lightning_wsync.callback.WeightSyncCallback"
    _convert_: str = "all"  # lists reach the callback as lists, not ListConfig
    every_n_steps: int = MISSING
    module: str | None = None
    store: str | None = None
    max_version_lag: int | None = None
    sharded: bool | str = "auto"  # True, False or "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = self.OWNER
        if isinstance(self.every_n_steps, bool) or not isinstance(self.every_n_steps, int) or self.every_n_steps < 1:
            raise ValueError(
                f"{owner}: every_n_steps={self.every_n_steps!r} must be an int >= 1 "
                f"(optimizer steps between pushes), e.g. every_n_steps=10"
            )
        parts = self.module.split(".") if isinstance(self.module, str) else [""]
        if self.module is not None and not all(part.isidentifier() or part.isdigit() for part in parts):
            raise ValueError(
                f"{owner}: module={self.module!r} must be an attribute path such as 'policy' or "
                f"'model.policy', or None for the whole LightningModule"
            )
        lag = self.max_version_lag
        if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 0):
            raise ValueError(
                f"{owner}: max_version_lag={lag!r} must be an int >= 0 (versions a receiver may fall "
                f"behind), or None to never wait for receivers"
            )
        if not isinstance(self.sharded, bool) and self.sharded != "auto":
            raise TypeError(f"{owner}: sharded={self.sharded!r} must be 'auto', True or False")
        if self.store is not None and not isinstance(self.store, str):
            raise TypeError(f"{owner}: store={self.store!r} must be a 'host:port' string or None for $WSYNC_STORE")

    def sender_config(self) -> SenderConfig:
        """The :class:`SenderConfig` part of these fields."""
        return SenderConfig(**config_values(SenderConfig, self, {}, owner=self.OWNER))


def register_configs(group: str = "wsync") -> None:
    """Store the configs in Hydra's ConfigStore under ``group``.

    Names: ``callback`` (:class:`CallbackConfig`), ``sender`` (:class:`SenderConfig`),
    ``receiver`` (:class:`ReceiverConfig`). Call it before ``@hydra.main`` runs; an
    app's YAML then selects one with ``defaults: [{wsync: callback}, _self_]``.
    """
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group=group, name="callback", node=CallbackConfig)
    store.store(group=group, name="sender", node=SenderConfig)
    store.store(group=group, name="receiver", node=ReceiverConfig)
