"""lightning_wsync inside ``vllm.AsyncLLM``: versions applied while requests stream.

::

    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from lightning_wsync.engines.vllm import WORKER_EXTENSION
    from lightning_wsync.engines.vllm_async import AsyncVllmWeightSync

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model_dir, worker_extension_cls=WORKER_EXTENSION))
    sync = await AsyncVllmWeightSync.start(engine)     # store, job, secret from WSYNC_* env
    await sync.wait_for_version(0)
    async for out in sync.generate(prompt, params, request_id="r1"):
        out.version, out.switches                       # which weights produced out.output
    await sync.update()                                 # from any task, any time
    await sync.close()

``update()`` stages the newest version in every worker while requests keep running
(:mod:`~lightning_wsync.engines._worker.commit`), then pauses the scheduler at a step boundary
(``pause_generation``), has every worker load it, and resumes. ``pause_mode``:

- ``"keep"`` (default): in-flight requests are frozen and continue after the update. With
  ``clear_cache=False`` (default) their KV cache, computed with the previous weights, is
  kept: no work is lost, but the rest of such a request attends to keys/values of the old
  version (slightly off-policy, as in PipelineRL-style in-flight updates). With
  ``clear_cache=True`` vLLM drops the KV and prefix caches.
- ``"abort"``: in-flight requests end at once (finish reason ``abort``): fully on-policy
  from the next request on, at the cost of the aborted work.

Every output of :meth:`generate` says which weights produced it: ``version`` at the
request's first token, and ``switches``, ``(token_index, version)`` for each update that
landed while it ran: tokens from ``token_index`` on were generated with ``version``. The
stamps come from vLLM's own per-token labels: while the engine is paused for an update,
the engine core's weight-version label is set to the new version, and the core attaches
it to every step's outputs from then on; the request's final output (also an aborted
one) carries them as ``weight_versions`` spans, exact whatever the stream had read and
whenever vLLM dropped the request's state. Outputs before the last are ``exact=False``:
their switches are placed at the first token the stream had not yet seen when the update
landed (the true index is that one or later). A load that fails in any worker labels
every token after the resume ``None`` (unknown) until an update succeeds: the engine may
hold a mix of two versions.

With ``lora=...`` (the trainer pushes a LoRA adapter; :mod:`~lightning_wsync.engines.lora`)
there is no pause and no switch: ``update()`` adds the new version as an in-memory adapter
between two engine steps, every request runs with the adapter of the newest version at its
start (``lora_request`` passed for it) and keeps it to its end, so its output carries one
``version`` and no ``switches`` (``exact`` from the first output on). Older adapters are
dropped once no request uses them and ``keep_adapters`` newer ones are loaded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_wsync.config import ReceiverConfig, config_values
from lightning_wsync.engines._worker.commit import (
    Call,
    Results,
    ZeroCopy,
    agree,
    load,
    run_async,
    unwrap,
    zero_copy_option,
)
from lightning_wsync.engines.lora import lora_options, lora_request
from lightning_wsync.engines.vllm_servers import UNKNOWN_LABEL
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)

PauseMode = Literal["keep", "abort"]



@dataclass
class VersionedOutput:
    """One streamed ``vllm.RequestOutput`` and the versions that produced its tokens."""

    output: Any
    version: int | None
    switches: list[tuple[int, int | None]] = field(default_factory=list)
    exact: bool = False  # True on the final output: stamps from vLLM's labels of each token

    def version_of(self, token_index: int) -> int | None:
        """The version that generated the token at ``token_index`` (None: unknown, after a
        failed load, or the engine's own weights before the first version)."""
        version = self.version
        for start, v in self.switches:
            if token_index >= start:
                version = v
        return version


@dataclass
class _Stream:
    """What one request's stream has seen: tokens, and the switches that landed meanwhile."""

    version: int | None
    seen: int = 0
    switches: list[tuple[int, int | None]] = field(default_factory=list)


def _version(label: str) -> int | None:
    return int(label) if label.isdigit() else None  # "default" (the checkpoint), UNKNOWN_LABEL-...


def _from_spans(out: Any, spans: Any, first: int | None) -> VersionedOutput:
    """The final output's stamps from vLLM's per-token labels (``WeightVersionSpan``s)."""
    if not spans:
        return VersionedOutput(out, first, [], exact=True)  # no token generated
    versions = [(span.start, _version(span.version)) for span in spans]
    return VersionedOutput(out, versions[0][1], versions[1:], exact=True)


class AsyncVllmWeightSync:
    """Keeps a ``vllm.AsyncLLM``'s workers at the newest version; stamps outputs with it.

    Create with :meth:`start`. Args as :class:`~lightning_wsync.engines.vllm.VllmWeightSync`
    (``lora`` and ``keep_adapters`` included), plus ``pause_mode`` and ``clear_cache`` (see the
    module docs).
    """

    def __init__(
        self, engine: Any, names: list[str], timeout_s: float, pause_mode: PauseMode, clear_cache: bool,
        lora: bool = False,
    ) -> None:  # fmt: skip
        self._engine = engine
        self.lora = lora
        self.names = names
        self.timeout_s = timeout_s
        self.pause_mode: PauseMode = pause_mode
        self.clear_cache = clear_cache
        self.version: int | None = None
        self.paused_s: list[float] = []  # engine paused time of each update
        self._streams: dict[str, _Stream] = {}
        self._lock = asyncio.Lock()  # one update at a time
        self._switching = asyncio.Lock()  # held from pause to resume: no request starts half-way

    @classmethod
    async def start(
        cls,
        engine: Any,
        store: str | None = None,
        job: str | None = None,
        *,
        name: str | None = None,
        pause_mode: PauseMode = "keep",
        clear_cache: bool = False,
        zero_copy: ZeroCopy = "auto",
        lora: object = None,
        keep_adapters: int | None = None,
        **options: object,
    ) -> AsyncVllmWeightSync:
        """Start a receiver in every worker of ``engine`` (created with ``worker_extension_cls=WORKER_EXTENSION``)."""
        if pause_mode not in ("keep", "abort"):
            raise ValueError(
                f"AsyncVllmWeightSync: pause_mode={pause_mode!r} is not one of 'keep', 'abort' "
                f"('wait' would block an update until every request finished)"
            )
        values = config_values(ReceiverConfig, None, {"name": name, **options}, owner="AsyncVllmWeightSync")
        timeout_s = ReceiverConfig(**values).timeout_s
        values.update(zero_copy_option("AsyncVllmWeightSync", zero_copy, values))
        values.update(lora_options("AsyncVllmWeightSync", lora, keep_adapters))
        try:
            names = list(await engine.collective_rpc("wsync_start", args=(store, job, values)))
        except Exception as exc:
            await engine.collective_rpc("wsync_close")  # workers that did start one stop it again
            raise WeightSyncError(
                f"AsyncVllmWeightSync: could not start a receiver in the engine's workers ({type(exc).__name__}: "
                f"{exc}); create the engine with worker_extension_cls=WORKER_EXTENSION, and check store={store!r}, "
                f"job={job!r}"
            ) from exc
        try:  # names checked now when the trainer published its layout first
            unwrap(list(await engine.collective_rpc("wsync_check_layout")), names, "start")
        except WeightSyncError:
            await engine.collective_rpc("wsync_close")
            raise
        return cls(engine, names, timeout_s, pause_mode, clear_cache, lora is not None)

    async def update(self) -> int | None:
        """Stage the newest version everywhere, then pause, load it in every worker, resume.

        Returns the version loaded, or None. Raises as :meth:`VllmWeightSync.update`.
        """
        async with self._lock:
            version = await run_async(agree(self.names, None, self.timeout_s), self._workers)
            return await self._switch(version)

    async def wait_for_version(self, min_version: int = 0, timeout_s: float | None = None) -> int:
        """Wait until every worker holds one version >= ``min_version``; return it."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        await self.update()
        async with self._lock:
            if self.version is None or self.version < min_version:
                await self._switch(await run_async(agree(self.names, min_version, timeout_s), self._workers))
        assert self.version is not None
        return self.version

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[VersionedOutput]:
        """``AsyncLLM.generate``, each output stamped with the versions that produced it."""
        async with self._switching:
            stream = self._streams[request_id] = _Stream(self.version)
        if self.lora:
            async for adapted in self._generate_adapted(prompt, params, request_id, stream.version):
                yield adapted
            return
        try:
            async for out in self._engine.generate(prompt, params, request_id):
                completion = out.outputs[0]
                spans = completion.weight_versions
                if completion.finish_reason is not None and spans is not None:
                    yield _from_spans(out, spans, stream.version)
                    continue
                stream.seen = len(completion.token_ids)
                yield VersionedOutput(out, stream.version, list(stream.switches))
        finally:
            del self._streams[request_id]

    async def _generate_adapted(
        self, prompt: Any, params: Any, request_id: str, version: int | None
    ) -> AsyncIterator[VersionedOutput]:
        """With ``lora``: the whole request on ``version``'s adapter (the base model before the first)."""
        request = None if version is None else lora_request(version)
        try:
            async for out in self._engine.generate(prompt, params, request_id, lora_request=request):
                yield VersionedOutput(out, version, [], exact=True)
        finally:
            del self._streams[request_id]

    async def state(self) -> list[dict[str, Any]]:
        """Per worker: version loaded, version staged, rejected count, newest published, sender closed."""
        return list(await self._engine.collective_rpc("wsync_state"))

    async def sender_closed(self) -> bool:
        """The sender announced its close (no newer version will come from it)."""
        return all(s["sender_closed"] for s in await self.state())

    async def close(self) -> None:
        """Stop the receivers in every worker; the engine keeps the weights it holds."""
        await self._engine.collective_rpc("wsync_close")

    async def _switch(self, version: int | None) -> int | None:
        if version is None or version == self.version:
            return None
        async with self._switching:  # with lora: no request starts while the adapters in use are read
            if self.lora:
                in_use = {s.version for s in self._streams.values() if s.version is not None}
                await run_async(load(self.names, version, self.timeout_s, sorted(in_use)), self._workers)
                self.version = version
                return version
            return await self._load(version)

    async def _load(self, version: int) -> int:
        loop = asyncio.get_running_loop()
        await self._engine.pause_generation(mode=self.pause_mode, clear_cache=self.clear_cache)
        paused = loop.time()
        try:
            self.version = None  # until every worker has loaded it
            try:
                await run_async(load(self.names, version, self.timeout_s), self._workers)
            except BaseException:
                await self._label(None, f"{UNKNOWN_LABEL}-{version}")  # the engine may hold a mix
                raise
            if not await self._engine.reset_prefix_cache():
                log.debug("prefix cache kept blocks of requests in flight (pause_mode=%r)", self.pause_mode)
            self.version = version
            await self._label(version, str(version))
        finally:
            await self._engine.resume_generation()
            self.paused_s.append(loop.time() - paused)
        return version

    async def _label(self, version: int | None, label: str) -> None:
        """While paused: the core labels every later token ``label``; streams note the switch."""
        await self._engine.update_weight_version(label)
        for stream in self._streams.values():
            if stream.seen == 0 and not stream.switches:
                stream.version = version  # provisional: the final output's labels say for sure
            else:
                stream.switches.append((stream.seen, version))

    async def _workers(self, call: Call) -> Results:
        return list(await self._engine.collective_rpc(call.method, timeout=call.timeout_s, args=call.args))
