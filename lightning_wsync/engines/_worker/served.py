"""In a vLLM server's worker: adapter versions that vLLM's own adapter routes load from memory.

A server names adapters itself: ``POST /v1/load_lora_adapter {"lora_name": "wsync-v7",
"lora_path": "wsync:v7"}`` gives the name an id of the API server's counter and asks every
worker to load it. :class:`ServedAdapters` holds the tensors of the newest ``keep``
versions the worker received; :func:`install_loader` makes vLLM's worker adapter loader
build a ``wsync:v{N}`` path from them (``LoRAModel.from_lora_tensors``, no file) under the
id the API server chose, and refuse a version it no longer holds, naming the ones it does.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Collection, Mapping
from typing import Any

import torch

from lightning_wsync.engines._worker.lora import peft_name, refused_lora_names
from lightning_wsync.errors import WeightSyncError

PATH_PREFIX = "wsync:v"
_PATH = re.compile(r"^wsync:v(\d+)$")

# The worker's adapter manager (``model.lora_manager``) -> the versions it may load.
_SERVED: dict[int, ServedAdapters] = {}
_install_lock = threading.Lock()
_installed = False


def adapter_path(version: int) -> str:
    """The ``lora_path`` that names ``version``'s adapter in memory (no file)."""
    return f"{PATH_PREFIX}{version}"


class ServedAdapters:
    """A server worker's adapter versions: the tensors of the newest ``keep``.

    Args:
        vllm_config: the worker's config (``--enable-lora`` and its limits).
        model: the worker's model (its ``lora_manager`` holds vLLM's loaded adapters).
        config: the adapter's LoRA config (:func:`~lightning_wsync.engines.lora.adapter_config`).
        keep: how many of the newest versions stay loadable (None: the server's ``--max-loras``).
    """

    def __init__(self, vllm_config: Any, model: Any, config: Mapping[str, Any], keep: int | None) -> None:
        from vllm.lora.peft_helper import PEFTHelper

        lora_config = vllm_config.lora_config
        manager = getattr(model, "lora_manager", None)
        if lora_config is None or manager is None:
            raise WeightSyncError(
                "wsync weight transfer: lora=... needs a server started with --enable-lora, "
                f"--max-lora-rank >= {config.get('r')!r} and --max-loras >= the versions to keep"
            )
        self.keep = int(lora_config.max_loras) if keep is None else int(keep)
        if self.keep < 1:
            raise WeightSyncError(f"wsync weight transfer: keep_adapters={keep!r} must be >= 1")
        text_config = vllm_config.model_config.hf_config.get_text_config()
        positions = getattr(text_config, "max_position_embeddings", None)
        self.helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": positions})
        try:
            self.helper.validate_legal(lora_config)
        except ValueError as exc:
            raise WeightSyncError(
                f"wsync weight transfer: the adapter does not fit the server's LoRA settings: {exc}"
            ) from exc
        self.manager = manager
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}  # oldest first
        self._lock = threading.Lock()  # versions land from the update thread, loads run in the engine loop

    @property
    def versions(self) -> list[int]:
        with self._lock:
            return list(self.tensors)

    def refused(self, names: Collection[str]) -> list[str]:
        """Names that would not load as this model's LoRA weights, each with why."""
        return refused_lora_names(self.manager, names)

    def add(self, version: int, tensors: Mapping[str, torch.Tensor]) -> list[int]:
        """Hold ``version``'s tensors (a private copy); drop versions beyond the newest ``keep``.
        Returns the versions dropped."""
        own = {peft_name(n): t.detach().to("cpu", copy=True) for n, t in tensors.items()}  # staged buffers are reused
        with self._lock:
            self.tensors.pop(version, None)
            self.tensors[version] = own
            dropped = list(self.tensors)[: max(0, len(self.tensors) - self.keep)]
            for old in dropped:
                del self.tensors[old]
        return dropped

    def build(self, worker_manager: Any, lora_request: Any) -> Any:
        """vLLM's adapter for ``lora_request`` (path ``wsync:v{N}``), under the id it carries.

        Raises:
            WeightSyncError: this worker holds no version N (never received, or dropped).
        """
        from vllm.lora.lora_model import LoRAModel

        version = int(_PATH.match(lora_request.lora_path)[1])  # type: ignore[index]  # checked by the caller
        with self._lock:
            tensors, held = self.tensors.get(version), list(self.tensors)
        if tensors is None:
            raise WeightSyncError(
                f"wsync: adapter {lora_request.lora_name!r} (version {version}) is not held by this server: it keeps "
                f"the newest {self.keep} versions, now {held!r} (keep_adapters; a request must finish before that "
                f"many newer versions land)"
            )
        mapper = getattr(self.manager.model, "hf_to_vllm_mapper", None)  # as vLLM's own adapter loader does
        own = {n: t.clone() for n, t in tensors.items()}  # vLLM scales lora_B in place; a rebuild starts afresh
        return LoRAModel.from_lora_tensors(
            lora_request.lora_int_id, own, self.helper, device="cpu",
            dtype=worker_manager.lora_config.lora_dtype, model_vocab_size=worker_manager.vocab_size,
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        )  # fmt: skip

    def serve(self) -> None:
        """Let this worker's adapter loader build ``wsync:v{N}`` paths from these versions."""
        install_loader()
        _SERVED[id(self.manager)] = self

    def close(self) -> None:
        if _SERVED.get(id(self.manager)) is self:
            del _SERVED[id(self.manager)]


def install_loader() -> None:
    """Wrap vLLM's ``WorkerLoRAManager._load_adapter`` in this process (once): a ``wsync:v{N}``
    path is built by the worker's :class:`ServedAdapters`; any other path loads as vLLM loads it."""
    global _installed
    from vllm.lora.worker_manager import WorkerLoRAManager

    with _install_lock:
        if _installed:
            return
        original = WorkerLoRAManager._load_adapter

        def _load_adapter(self: Any, lora_request: Any) -> Any:
            if not _PATH.match(lora_request.lora_path or ""):
                return original(self, lora_request)
            served = _SERVED.get(id(self._adapter_manager))
            if served is None:
                raise WeightSyncError(
                    f"wsync: adapter {lora_request.lora_name!r} ({lora_request.lora_path}) names a wsync version, but "
                    f"this server received none: init_weight_transfer_engine with options {{'lora': ...}} first"
                )
            return served.build(self, lora_request)

        WorkerLoRAManager._load_adapter = _load_adapter
        _installed = True
