"""One version in every worker of an engine, or none: stage everywhere, then apply.

An engine with tensor (or pipeline) parallelism runs one :class:`WeightReceiver` per
worker. A worker's receiver only *stages* a version (its apply target keeps the verified
tensors, the model is untouched, see :class:`StagedVersion`); the driver then brings
every worker to the same staged version and only then asks each to load it::

    stage   every worker stages its newest version          (model untouched)
    agree   workers behind the newest staged one stage >= it (repeat until all equal)
    apply   every worker loads that one version             (prefix cache reset once)

A push landing between two workers' stages only makes the laggard stage again; a worker
that cannot stage the agreed version within ``timeout_s`` stops the round before any
model is written, so the engine stays on its previous version everywhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypeVar, cast

import torch

from lightning_wsync import errors
from lightning_wsync.errors import WeightSyncError, WeightSyncTimeoutError

log = logging.getLogger(__name__)

ZeroCopy = bool | Literal["auto"]

T = TypeVar("T")

RPC_MARGIN_S = 30.0
"""Slack on top of ``timeout_s`` for one collective call (process hops, a slow reload)."""


class Call(NamedTuple):
    """One method of the worker extension, to run in every worker (results in worker order)."""

    method: str
    args: tuple[Any, ...]
    timeout_s: float


Results = list[dict[str, Any]]
Steps = Generator[Call, Results, T]
"""A round as the calls it needs: the sync (``run``) and async (``run_async``) drivers make them."""


def run(steps: Steps[T], workers: Callable[[Call], Results]) -> T:
    try:
        call = next(steps)
        while True:
            call = steps.send(workers(call))
    except StopIteration as done:
        return cast(T, done.value)


async def run_async(steps: Steps[T], workers: Callable[[Call], Awaitable[Results]]) -> T:
    try:
        call = next(steps)
        while True:
            call = steps.send(await workers(call))
    except StopIteration as done:
        return cast(T, done.value)


class StagedVersion:
    """An ApplyTarget that keeps a verified version for a later load instead of loading it.

    The tensors are the receiver's own copy; they stay as they are until the receiver's
    next ``update()``, which only the stage step calls.
    """

    def __init__(self) -> None:
        self.version: int | None = None
        self.tensors: Mapping[str, torch.Tensor] = {}

    def __call__(self, tensors: Mapping[str, torch.Tensor], version: int, /) -> None:
        self.tensors, self.version = tensors, version


def outcome(call: Callable[[], int | None]) -> dict[str, Any]:
    """A worker's result, or the WeightSyncError it raised, as plain data.

    In multi-process mode vLLM wraps a worker's exception into its own; the driver
    raises the receiver's error class again from this record (:func:`unwrap`).
    """
    try:
        return {"version": call()}
    except WeightSyncError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}


def unwrap(results: Sequence[dict[str, Any]], names: Sequence[str], step: str) -> list[int | None]:
    """Each worker's version; the first worker's error raised again as its own class, named."""
    for name, r in zip(names, results):
        if "error" in r:
            cls = getattr(errors, r["error"], WeightSyncError)
            raise cls(f"{step} in worker {name!r}: {r['message']}")
    return [r["version"] for r in results]


def agree(names: Sequence[str], min_version: int | None, timeout_s: float) -> Steps[int | None]:
    """Stage one version in every worker (>= ``min_version`` if given); return it, or None.

    None: some worker has no version staged yet and ``min_version`` is None.

    Raises:
        WeightSyncTimeoutError: a worker did not stage the agreed version within ``timeout_s``
            (no model was written).
    """
    deadline = time.monotonic() + timeout_s
    first_s = 0.0 if min_version is None else timeout_s
    try:
        staged = unwrap((yield Call("wsync_stage", (min_version, first_s), first_s + RPC_MARGIN_S)), names, "stage")
    except WeightSyncTimeoutError as exc:
        raise WeightSyncTimeoutError(f"engine: {exc}; no worker loaded a new version") from exc
    while True:
        known = [v for v in staged if v is not None]
        if len(known) == len(staged) and len(set(known)) == 1:
            return known[0]
        if not known:
            return None
        target = max(known)
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise WeightSyncTimeoutError("out of time")
            staged = unwrap((yield Call("wsync_stage", (target, remaining), remaining + RPC_MARGIN_S)), names, "stage")
        except WeightSyncTimeoutError as exc:
            behind = [n for n, v in zip(names, staged) if v != target]
            raise WeightSyncTimeoutError(
                f"engine workers {behind!r} did not stage version {target} within timeout_s={timeout_s} "
                f"(staged {dict(zip(names, staged))!r}); no worker loaded it, the engine keeps its previous "
                f"version everywhere. Raise timeout_s, or push less often than the engine stages ({exc})"
            ) from exc


def load(names: Sequence[str], version: int, timeout_s: float, in_use: Sequence[int] = ()) -> Steps[None]:
    """Every worker loads its staged ``version`` (LoRA: keeping the adapters ``in_use`` by requests).

    Raises:
        WeightSyncError: a worker's load failed; the engine may hold part of ``version``.
    """
    try:
        loaded = unwrap((yield Call("wsync_load", (version, sorted(in_use)), timeout_s + RPC_MARGIN_S)), names, "load")
    except WeightSyncError as exc:
        raise type(exc)(
            f"engine: loading version {version} failed ({exc}); workers may hold parts of different "
            f"versions until the next update() loads the newest everywhere"
        ) from exc
    assert loaded == [version] * len(names), loaded


def zero_copy_option(owner: str, zero_copy: ZeroCopy, values: Mapping[str, Any]) -> dict[str, ZeroCopy]:
    """The worker option for ``zero_copy`` (none when off), checked against the receiver's options.

    ``"auto"`` (the default) is on unless ``fleet`` is set (a fleet member stages its round's version in a
    private copy), which is said here, once; each worker says once whether its versions come from the
    trainer host's ring (lent) or another way (copied), see ``ZeroCopyNote``."""
    if zero_copy != "auto" and not isinstance(zero_copy, bool):
        raise TypeError(f"{owner}: zero_copy={zero_copy!r} must be True, False or 'auto'")
    fleet = values.get("fleet")
    if zero_copy is True and fleet is not None:
        raise ValueError(
            f"{owner}: zero_copy=True with fleet={fleet!r}: a fleet member stages its round's "
            f"version in a private copy; leave one of them out"
        )
    if zero_copy == "auto" and fleet is not None:
        log.info("%s: zero_copy off: with fleet=%r each worker stages its round's version in a private copy", owner,
                 fleet)  # fmt: skip
        return {}
    return {"zero_copy": zero_copy} if zero_copy else {}


class ZeroCopyNote:
    """A worker's word on whether it loads versions out of shared memory: said when first known, and again
    whenever it changes (a relaunched trainer on another host, a ring the worker could not map)."""

    def __init__(self, name: str, mode: ZeroCopy) -> None:
        self._name = name
        self._mode = mode
        self._said: bool | None = None

    def saw(self, lends: bool) -> None:
        if lends == self._said:
            return
        self._said = lends
        if lends:
            log.info(
                "vLLM worker %r: zero_copy=%r is on: versions load straight out of the trainer host's shared "
                "memory; while a version is lent (stage to load) a push is dropped if the ring's other slot is being "
                "read too (WeightSender.dropped_pushes, wsync/dropped); zero_copy=False turns it off (docs/engines.md)",
                self._name, self._mode,
            )  # fmt: skip
        else:
            log.info(
                "vLLM worker %r: zero_copy=%r is off here: versions reach this worker over the network or from a "
                "relay host's ring (not a ring of the trainer's host it can map), so each is copied",
                self._name, self._mode,
            )  # fmt: skip
