"""Stamps that never lie, against a fake ``AsyncLLM`` that controls when things happen.

The fake labels each token with the engine core's weight-version label at the step that
made it (as vLLM 0.32 does), drops a request's state the moment it finishes (before its
stream has read it), and lets the test decide when streams read. No vLLM needed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from lightning_wsync.engines.vllm_async import AsyncVllmWeightSync, VersionedOutput

pytestmark = pytest.mark.timeout(30)


@dataclass
class Span:  # vllm.outputs.WeightVersionSpan
    version: str
    start: int
    end: int


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str | None = None
    weight_versions: list[Span] | None = None


@dataclass
class Output:
    outputs: list[Completion]


@dataclass
class Request:
    max_tokens: int
    queue: asyncio.Queue[Output] = field(default_factory=asyncio.Queue)
    labels: list[str] = field(default_factory=list)


class FakeEngine:
    """Just enough of ``AsyncLLM`` and the worker extension for ``AsyncVllmWeightSync``."""

    def __init__(self) -> None:
        self.label = "default"
        self.staged = 0
        self.fail_load = False
        self.paused = False
        self.request_states: dict[str, Request] = {}  # dropped on finish, as vLLM's may be

    def step(self) -> None:
        assert not self.paused
        for rid, req in list(self.request_states.items()):
            req.labels.append(self.label)
            done = len(req.labels) == req.max_tokens
            self._emit(req, "length" if done else None)
            if done:
                del self.request_states[rid]

    def abort_all(self) -> None:
        for rid, req in list(self.request_states.items()):
            self._emit(req, "abort")
            del self.request_states[rid]

    @staticmethod
    def _emit(req: Request, finish: str | None) -> None:
        spans = None
        if finish is not None:
            spans, start = [], 0
            for i, label in enumerate(req.labels + [None]):  # type: ignore[operator]
                if i == len(req.labels) or label != req.labels[start]:
                    if i > start:
                        spans.append(Span(req.labels[start], start, i))
                    start = i
        req.queue.put_nowait(Output([Completion(list(range(len(req.labels))), finish, spans)]))

    async def generate(self, prompt: Any, params: Any, request_id: str):
        req = self.request_states[request_id] = Request(params)
        while True:
            out = await req.queue.get()
            yield out
            if out.outputs[0].finish_reason is not None:
                return

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = ()) -> list[dict]:
        if method == "wsync_stage":
            return [{"version": self.staged}]
        if method == "wsync_load" and self.fail_load:
            return [{"error": "WeightSyncError", "message": "reload_weights raised half-way"}]
        if method == "wsync_load":
            return [{"version": args[0]}]
        raise AssertionError(method)

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.paused = True
        if mode == "abort":
            self.abort_all()

    async def resume_generation(self) -> None:
        self.paused = False

    async def reset_prefix_cache(self) -> bool:
        return True

    async def update_weight_version(self, label: str) -> None:
        assert self.paused, "the label changes only while generation is paused"
        self.label = label


async def _drain(sync: AsyncVllmWeightSync, rid: str, tokens: int, read: asyncio.Event) -> list[VersionedOutput]:
    """Read the stream; after the first output, only once ``read`` is set (a lagging client)."""
    outs = []
    async for out in sync.generate({"prompt_token_ids": [1]}, tokens, rid):
        outs.append(out)
        await read.wait()
    return outs


async def _running(tokens: int, *, lag: bool = False, pause_mode: str = "keep"):
    """An engine at version 0 and one request of ``tokens`` tokens that has made its first token
    (read by the stream, which then lags until ``read`` is set when ``lag``)."""
    engine = FakeEngine()
    sync = AsyncVllmWeightSync(engine, ["w0"], timeout_s=5, pause_mode=pause_mode, clear_cache=False)  # type: ignore[arg-type]
    assert await sync.update() == 0
    read = asyncio.Event()
    if not lag:
        read.set()
    task = asyncio.create_task(_drain(sync, "r", tokens, read))
    await _yield()
    engine.step()
    await _yield()
    return engine, sync, task, read


async def _yield() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_request_that_finished_before_an_update_its_stream_had_not_read_keeps_its_version():
    async def main() -> None:
        engine, sync, task, read = await _running(4, lag=True)
        for _ in range(3):
            engine.step()  # all four tokens made by version 0; the state is gone, the stream read one
        assert "r" not in engine.request_states
        engine.staged = 1
        assert await sync.update() == 1
        read.set()
        final = (await task)[-1]
        assert final.exact and final.version == 0 and final.switches == []
        assert [final.version_of(i) for i in range(4)] == [0, 0, 0, 0]

    asyncio.run(main())


def test_a_request_spanning_an_update_is_stamped_at_the_token_the_new_version_made():
    async def main() -> None:
        engine, sync, task, _ = await _running(5)
        engine.step()  # tokens 0, 1: version 0
        engine.staged = 1
        await sync.update()
        for _ in range(3):
            engine.step()
        outs = await task
        final = outs[-1]
        assert final.exact and [final.version_of(i) for i in range(5)] == [0, 0, 1, 1, 1]
        assert not any(o.exact for o in outs[:-1])

    asyncio.run(main())


def test_an_aborted_request_keeps_the_version_that_made_its_tokens():
    async def main() -> None:
        engine, sync, task, read = await _running(8, lag=True, pause_mode="abort")
        engine.step()
        engine.staged = 1
        await sync.update()  # aborts "r"
        read.set()
        final = (await task)[-1]
        assert final.output.outputs[0].finish_reason == "abort"
        assert final.exact and final.version == 0 and final.switches == []

    asyncio.run(main())


def test_after_a_failed_load_tokens_are_unknown_until_an_update_succeeds():
    from lightning_wsync.errors import WeightSyncError

    async def main() -> None:
        engine, sync, task, _ = await _running(6)  # token 0: version 0
        engine.staged, engine.fail_load = 1, True
        with pytest.raises(WeightSyncError, match="half-way"):
            await sync.update()
        assert sync.version is None
        engine.step()
        engine.step()  # tokens 1, 2: the engine may hold a mix
        engine.staged, engine.fail_load = 2, False
        assert await sync.update() == 2
        for _ in range(3):
            engine.step()  # tokens 3-5: version 2
        final = (await task)[-1]
        assert [final.version_of(i) for i in range(6)] == [0, None, None, 2, 2, 2]

    asyncio.run(main())
