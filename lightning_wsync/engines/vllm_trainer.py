"""vLLM's trainer API on lightning_wsync: the ``wsync`` ``TrainerWeightTransferEngine``.

A trainer written against vLLM's API pushes through wsync by naming the backend::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from lightning_wsync.engines.vllm_trainer import WsyncClients, WsyncTrainerInitInfo

    client = WsyncClients([HTTPVLLMWeightSyncClient(url) for url in urls])  # or one client
    info = WsyncTrainerInitInfo(store="trainer-host:29500", job="run1", rank=0)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(policy))
    engine.send_weights()            # version 0 published, then loaded by every server
    engine.send_weights()            # version 1 ...

``send_weights()`` copies the source into the sender's tensors (every trainer rank
iterates the source, so FSDP's gathers stay in step), publishes it as the next version
through a :class:`WeightSender` (shared memory, gloo or the relay, as for any receiver),
then drives ``start_weight_update`` / ``update_weights({"version": v})`` /
``finish_weight_update(weight_version=str(v))`` on every server: each server loads
exactly ``v`` in all its workers or none, so ``/weight_info`` reports the version the
server holds. Importing this module registers the engine (the factory dispatches on
``WsyncTrainerInitInfo.backend``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from typing_extensions import Self, override
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    materialize_full_tensor,
)
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from lightning_wsync._control.store import resolve_job
from lightning_wsync._push.sender import WeightSender
from lightning_wsync.engines._vllm_plugin import BACKEND
from lightning_wsync.engines.vllm_servers import PAUSE_MODES, VllmServers, apply_version
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)


@dataclass
class WsyncTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc]  # vLLM is untyped where mypy runs
    """The trainer side's init info (``rank`` keyword-only, from vLLM's base: rank 0 sends).

    Attributes:
        store: ``"host:port"`` of the job's store, served by the trainer when the port is
            free here; the servers connect to it (default ``$WSYNC_STORE`` on both sides).
        job: the job's name (default ``$WSYNC_JOB``).
        first_version: the version number of the first ``send_weights()``; each next one adds 1.
        timeout_s: bound on each server staging a version.
        sender_options: :class:`~lightning_wsync.SenderConfig` fields (``dtype``, ``secret``, ...).
        server_options: :class:`~lightning_wsync.ReceiverConfig` fields for the servers'
            receivers (``verify``, ``fleet``, ...; never ``secret``: the servers read
            ``$WSYNC_SECRET``, it does not travel over HTTP).
        reset_prefix_cache: after each version, POST ``/reset_prefix_cache`` (a vLLM dev
            route, on with ``VLLM_SERVER_DEV_MODE=1`` like the RL routes) to every
            :class:`HTTPVLLMWeightSyncClient`, so no prompt is served from attention
            state of the previous version (blocks of requests in flight are kept).
        pause_mode: ``/pause?mode=...`` around the load on every HTTP server (``"keep"``:
            requests in flight freeze at a step boundary and go on after it; ``"abort"``;
            None: no pause). Each version is staged first, while requests run; paused, the
            workers load it and the server's weight-version label is set, so every token's
            label (``weight_versions`` on ``/inference/v1/generate``) is the version that
            made it. Without a pause, tokens of the steps between a load and the label
            carry the previous label.
    """

    backend: ClassVar[str] = BACKEND

    store: str | None = None
    job: str | None = None
    first_version: int = 0
    timeout_s: float = 120.0
    sender_options: dict[str, Any] = field(default_factory=dict)
    server_options: dict[str, Any] = field(default_factory=dict)
    reset_prefix_cache: bool = True
    pause_mode: str | None = "keep"

    def __post_init__(self) -> None:
        if "secret" in self.server_options:
            raise ValueError(
                "WsyncTrainerInitInfo: server_options may not carry 'secret' (it would travel in the "
                "clear over HTTP); set WSYNC_SECRET in the servers' environment"
            )
        if self.pause_mode not in (*PAUSE_MODES, None):
            raise ValueError(
                f"WsyncTrainerInitInfo: pause_mode={self.pause_mode!r} is not one of 'keep', 'abort', None"
            )
        if isinstance(self.first_version, bool) or not isinstance(self.first_version, int) or self.first_version < 0:
            raise ValueError(f"WsyncTrainerInitInfo: first_version={self.first_version!r} must be an int >= 0")


class WsyncClients:
    """Several servers as one :class:`VLLMWeightSyncClient`: each call runs on all of them at
    once and returns when all have answered (the first error is raised, naming the server)."""

    def __init__(self, clients: Sequence[VLLMWeightSyncClient]) -> None:
        if not clients:
            raise ValueError("WsyncClients: clients=[] names no server; pass one client per server")
        self.clients = list(clients)

    def _each(self, call: Callable[[VLLMWeightSyncClient], None]) -> None:
        with ThreadPoolExecutor(len(self.clients), thread_name_prefix="wsync-clients") as pool:
            futures = [pool.submit(call, c) for c in self.clients]
        for client, future in zip(self.clients, futures):
            exc = future.exception()
            if exc is not None:
                raise WeightSyncError(f"server {_where(client)}: {type(exc).__name__}: {exc}") from exc

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._each(lambda c: c.init_weight_transfer_engine(init_info))

    def start_weight_update(self) -> None:
        self._each(lambda c: c.start_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._each(lambda c: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each(lambda c: c.finish_weight_update(weight_version))


class _Tensors(nn.Module):
    """The sender's tensors: a private copy of the source, refreshed by each ``send_weights``."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.tensors = dict(tensors)

    @override
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return dict(self.tensors)


class WsyncTrainerEngine(TrainerWeightTransferEngine[WsyncTrainerInitInfo]):  # type: ignore[misc]
    """vLLM's trainer engine over a :class:`WeightSender`; see the module docs."""

    init_info_cls = WsyncTrainerInitInfo

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: WeightSource, init_info: WsyncTrainerInitInfo
    ) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.info = init_info
        self.next_version = init_info.first_version
        self.version: int | None = None  # the last version every server loaded
        self.sender: WeightSender | None = None
        # The sender's private copy; other ranks only take part in the source's collectives.
        self._tensors = _Tensors(_copy(source) if self.is_sender else {})
        if not self.is_sender:
            for _ in _materialized(source):
                pass

    @classmethod
    @override
    def trainer_init(
        cls, init_info: WsyncTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        if source is None:
            raise ValueError("wsync trainer engine: source=None; pass a WeightSource (e.g. ModuleSource(model))")
        engine = cls(client=client, source=source, init_info=init_info)
        if not engine.is_sender:
            return engine
        info = init_info
        engine.sender = WeightSender(engine._tensors, info.store, info.job, **info.sender_options)
        store, job = engine.sender.store_address, resolve_job(info.job, "WsyncTrainerEngine")
        client.init_weight_transfer_engine(
            {"store": store, "job": job, "options": {"timeout_s": info.timeout_s, **info.server_options}}
        )
        log.info("wsync trainer engine: servers joined job %r at %s", job, store)
        return engine

    @override
    def send_weights(self) -> None:
        version = self.next_version
        with torch.no_grad():
            for name, tensor in _materialized(self.source):  # every rank: the source's gathers are collectives
                if self.sender is not None:
                    self._tensors.tensors[name].copy_(tensor)
        self.next_version = version + 1  # a version number is used once, published or not
        if self.sender is None:
            return
        info = self.info
        if self.sender.push(version, wait_for_slot_s=info.timeout_s).dropped:
            raise WeightSyncError(
                f"wsync trainer engine: version {version} was not published: receivers were still reading both "
                f"snapshot slots after timeout_s={info.timeout_s}; call send_weights() again, or raise timeout_s"
            )
        apply_version(self.client, _http_servers(self.client), version, timeout_s=info.timeout_s,
                      pause_mode=info.pause_mode, reset_prefix_cache=info.reset_prefix_cache)  # fmt: skip
        self.version = version
        log.debug("wsync trainer engine: version %d loaded by every server", version)

    @override
    def shutdown(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()


def _materialized(source: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    for name, tensor in source:
        yield name, materialize_full_tensor(tensor).detach()  # FSDP's DTensor: a gather


def _copy(source: WeightSource) -> dict[str, torch.Tensor]:
    return {name: tensor.to("cpu", copy=True) for name, tensor in _materialized(source)}


def _where(client: VLLMWeightSyncClient) -> str:
    return repr(client.base_url) if isinstance(client, HTTPVLLMWeightSyncClient) else type(client).__name__


def _http_servers(client: VLLMWeightSyncClient) -> VllmServers | None:
    """The HTTP servers behind ``client``, for the routes beside vLLM's four (pause, resume, reset)."""
    if isinstance(client, VllmServers):
        return client
    clients = client.clients if isinstance(client, WsyncClients) else [client]
    http = [c for c in clients if isinstance(c, HTTPVLLMWeightSyncClient)]
    return VllmServers([c.base_url for c in http], timeout_s=float(http[0].timeout)) if http else None


if BACKEND not in WeightTransferTrainerFactory._registry:
    WeightTransferTrainerFactory.register_engine(BACKEND, WsyncTrainerEngine)
