"""Experience from rollout workers back to the trainer: a small bounded queue on the store.

Each item is a dict of tensors tagged with the weights version that produced it. The
queue lives on the control-plane store (``channel/<name>/queue`` under the job), so it
suits the modest rates of an actor-learner loop (episodes, not raw frames at GB/s).
Items are encoded as a JSON header plus raw tensor bytes; nothing is unpickled. With
the job's shared secret (``secret=`` or ``WSYNC_SECRET``) every item carries an
HMAC-SHA256 over the queue's key and its bytes, and the reader refuses items that are
unsigned, signed with another secret, malformed, or above ``max_item_mb``, with an
error saying which (never a crash inside the decoder).

Rollout side::

    writer = ExperienceWriter()                      # store and job from WSYNC_* env
    writer.put({"obs": obs, "actions": actions}, version=receiver.version)

Trainer side (every DDP rank pops its own share)::

    loader = DataLoader(ExperienceReader(), batch_size=None)
    for item in loader:  # {"obs": ..., "actions": ..., "version": tensor(7)}
        ...
"""

from __future__ import annotations

import hmac
import json
import math
import struct
import time
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from lightning_wsync._control import keys
from lightning_wsync._control.manifest import dtype_from_name, dtype_to_name
from lightning_wsync._control.signing import resolve_secret
from lightning_wsync._control.store import Control, connect_store, resolve_job
from lightning_wsync.errors import (
    WeightSyncAuthError,
    WeightSyncIntegrityError,
    WeightSyncTimeoutError,
)

VERSION_KEY = "version"
_POLL_S = 0.002
_HEADER = struct.Struct("<I")
_MAC_BYTES = 32
_UNSIGNED = bytes(_MAC_BYTES)


def encode(sample: Mapping[str, torch.Tensor], version: int) -> bytes:
    """A JSON header (names, dtypes, shapes, version) followed by each tensor's bytes."""
    if VERSION_KEY in sample:
        raise ValueError(f"experience sample: key {VERSION_KEY!r} is reserved for the weights version; rename it")
    tensors = []
    meta = []
    for name, t in sample.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"experience sample: {name!r} is {type(t).__name__}, expected a torch.Tensor")
        t = t.detach().to("cpu").contiguous()
        tensors.append(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        meta.append([name, dtype_to_name(t.dtype), list(t.shape)])
    header = json.dumps({"version": int(version), "tensors": meta}, separators=(",", ":")).encode()
    return _HEADER.pack(len(header)) + header + b"".join(tensors)


def decode(raw: bytes) -> dict[str, torch.Tensor]:
    """Inverse of :func:`encode`; raises :class:`WeightSyncIntegrityError` on malformed bytes."""
    try:
        return _decode(raw)
    except WeightSyncIntegrityError:
        raise
    except (struct.error, ValueError, TypeError, KeyError, IndexError, RuntimeError, OverflowError) as exc:
        raise WeightSyncIntegrityError(f"experience item of {len(raw)} bytes is malformed: {exc}") from None


def _decode(raw: bytes) -> dict[str, torch.Tensor]:
    (n,) = _HEADER.unpack_from(raw)
    if _HEADER.size + n > len(raw):
        raise ValueError(f"header length {n} runs past the end")
    header = json.loads(raw[_HEADER.size : _HEADER.size + n])
    version = header["version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"version {version!r} is not an int")
    out: dict[str, torch.Tensor] = {}
    offset = _HEADER.size + n
    for name, dtype_name, shape in header["tensors"]:
        if not isinstance(name, str) or name == VERSION_KEY or name in out:
            raise ValueError(f"tensor name {name!r} is not a fresh string key")
        dims_ok = isinstance(shape, list) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        )
        if not dims_ok:
            raise ValueError(f"shape {shape!r} of {name!r} is not a list of ints >= 0")
        dtype = dtype_from_name(str(dtype_name))
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > len(raw):
            raise ValueError(f"{name!r} needs {nbytes} bytes at offset {offset}, past the end")
        buf = bytearray(raw[offset : offset + nbytes])
        out[name] = torch.frombuffer(buf, dtype=dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
        offset += nbytes
    if offset != len(raw):
        raise ValueError(f"{len(raw) - offset} bytes left over after the tensors")
    out[VERSION_KEY] = torch.tensor(version, dtype=torch.int64)
    return out


class _Queue:
    """A bounded FIFO on the store, items signed with the job secret when one is set.

    The bound is read from the store's queue length, not kept in a counter of its own,
    so a writer or reader killed mid-operation leaks no capacity (writers racing for the
    last slot may overshoot it by one item each).
    """

    def __init__(self, control: Control, name: str, *, capacity: int, max_item_mb: float) -> None:
        self._ctl = control
        self._name = name
        self._queue_key = keys.channel_queue(name)
        self.capacity = capacity
        self.max_item_mb = max_item_mb
        self.max_item_bytes = int(max_item_mb * 2**20)

    def try_push(self, payload: bytes) -> bool:
        if self._ctl.queue_len(self._queue_key) >= self.capacity:
            return False
        self._ctl.queue_push(self._queue_key, self._mac(payload) + payload)
        return True

    def try_pop(self) -> dict[str, torch.Tensor] | None:
        item = self._ctl.queue_pop(self._queue_key)
        return None if item is None else self._open(item)

    def _mac(self, payload: bytes) -> bytes:
        return self._ctl.mac_bytes(self._queue_key.encode() + b"\0" + payload)

    def _open(self, item: bytes) -> dict[str, torch.Tensor]:
        what = f"experience channel {self._name!r}: an item of {len(item)} bytes"
        if len(item) > self.max_item_bytes + _MAC_BYTES:
            raise WeightSyncIntegrityError(
                f"{what} is above max_item_mb={self.max_item_mb!r}; it was dropped. Raise "
                f"max_item_mb on the ExperienceReader (and the writers), or put smaller items"
            )
        mac, payload = item[:_MAC_BYTES], item[_MAC_BYTES:]
        if len(item) < _MAC_BYTES:
            raise WeightSyncIntegrityError(f"{what} is malformed (shorter than its signature); it was dropped")
        if self._ctl.secret is None:
            if mac != _UNSIGNED:
                raise WeightSyncAuthError(
                    f"{what} is signed but this reader has no secret; set the job's secret= / WSYNC_SECRET"
                )
        elif not hmac.compare_digest(mac, self._mac(payload)):
            how = "not signed" if mac == _UNSIGNED else "signed with a different secret"
            raise WeightSyncAuthError(
                f"{what} is {how}; it was dropped. Set the same secret= / WSYNC_SECRET on every writer"
            )
        try:
            return decode(payload)
        except WeightSyncIntegrityError as exc:
            raise WeightSyncIntegrityError(f"{what} was dropped: {exc}") from None

    def __len__(self) -> int:
        return self._ctl.queue_len(self._queue_key)


def _check(
    owner: str, channel: str, capacity: int, timeout_s: float, max_item_mb: float, timeout_name: str = "timeout_s"
) -> None:
    if isinstance(max_item_mb, bool) or not isinstance(max_item_mb, (int, float)) or not max_item_mb > 0:
        raise ValueError(f"{owner}: max_item_mb={max_item_mb!r} must be a number > 0 (MiB per item)")
    if not channel or "/" in channel:
        raise ValueError(f"{owner}: channel={channel!r} must be a non-empty name without '/'")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"{owner}: capacity={capacity!r} must be an int >= 1 (items held at most)")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"{owner}: {timeout_name}={timeout_s!r} must be > 0 (seconds)")


class ExperienceWriter:
    """Rollout side of the channel.

    Args:
        store: Store or ``"host:port"``; default ``$WSYNC_STORE``.
        job: default ``$WSYNC_JOB``.
        channel: queue name, so one job can carry several streams.
        capacity: items the queue holds at most; ``put`` waits (bounded) while full.
        timeout_s: bound on that wait.
        secret: the job's shared secret (default ``$WSYNC_SECRET``); signs every item.
        max_item_mb: largest encoded item ``put`` accepts (the reader's bound must be as large).
    """

    def __init__(
        self,
        store: dist.Store | str | None = None,
        job: str | None = None,
        *,
        channel: str = "experience",
        capacity: int = 64,
        timeout_s: float = 30.0,
        secret: str | None = None,
        max_item_mb: float = 64.0,
    ) -> None:
        _check("ExperienceWriter", channel, capacity, timeout_s, max_item_mb)
        key = resolve_secret(secret, "ExperienceWriter")
        handle = connect_store(store, serve=False, timeout_s=timeout_s, owner="ExperienceWriter")
        control = Control(handle.store, resolve_job(job, "ExperienceWriter"), key)
        self._queue = _Queue(control, channel, capacity=capacity, max_item_mb=max_item_mb)
        self._channel = channel
        self.timeout_s = timeout_s
        self.dropped = 0

    def put(self, sample: Mapping[str, torch.Tensor], version: int, *, block: bool = True) -> bool:
        """Enqueue ``sample`` tagged with ``version``.

        With ``block`` it waits up to ``timeout_s`` for room and raises
        :class:`WeightSyncTimeoutError` after; without, a full queue drops the sample
        (counted in ``dropped``) and returns False.
        """
        payload = encode(sample, version)
        if len(payload) > self._queue.max_item_bytes:
            raise ValueError(
                f"ExperienceWriter.put: the item encodes to {len(payload)} bytes, above "
                f"max_item_mb={self._queue.max_item_mb!r}; put smaller items or raise max_item_mb "
                f"(on the ExperienceReader too)"
            )
        deadline = time.monotonic() + self.timeout_s
        while not self._queue.try_push(payload):
            if not block:
                self.dropped += 1
                return False
            if time.monotonic() >= deadline:
                raise WeightSyncTimeoutError(
                    f"ExperienceWriter: channel {self._channel!r} stayed full (capacity={self._queue.capacity}) "
                    f"for timeout_s={self.timeout_s}; is the trainer consuming? use put(block=False) to drop instead"
                )
            time.sleep(_POLL_S)
        return True


class ExperienceReader(IterableDataset[dict[str, torch.Tensor]]):
    """Trainer side: an endless ``IterableDataset`` of experience items (use ``batch_size=None``).

    Each item is the producer's dict plus ``"version"`` (int64 scalar tensor). Iteration
    raises :class:`WeightSyncTimeoutError` when nothing arrives for ``idle_timeout_s``,
    :class:`WeightSyncAuthError` for an item not signed with ``secret`` (default
    ``$WSYNC_SECRET``), :class:`WeightSyncIntegrityError` for a malformed item or one
    above ``max_item_mb`` (the item is dropped: iterate again to go on), and ends after
    ``max_items`` if given. The store connection opens on first
    iteration, so the dataset can be built before the rendezvous store exists.
    """

    def __init__(
        self,
        store: str | None = None,
        job: str | None = None,
        *,
        channel: str = "experience",
        idle_timeout_s: float = 120.0,
        max_items: int | None = None,
        secret: str | None = None,
        max_item_mb: float = 64.0,
    ) -> None:
        _check("ExperienceReader", channel, 1, idle_timeout_s, max_item_mb, "idle_timeout_s")
        self._secret = secret
        self.max_item_mb = max_item_mb
        self._store = store
        self._job = job
        self._channel = channel
        self.idle_timeout_s = idle_timeout_s
        self.max_items = max_items

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        key = resolve_secret(self._secret, "ExperienceReader")
        handle = connect_store(self._store, serve=False, timeout_s=self.idle_timeout_s, owner="ExperienceReader")
        control = Control(handle.store, resolve_job(self._job, "ExperienceReader"), key)
        queue = _Queue(control, self._channel, capacity=0, max_item_mb=self.max_item_mb)
        served = 0
        while self.max_items is None or served < self.max_items:
            deadline = time.monotonic() + self.idle_timeout_s
            while (item := queue.try_pop()) is None:
                if time.monotonic() >= deadline:
                    raise WeightSyncTimeoutError(
                        f"ExperienceReader: nothing arrived on channel {self._channel!r} for "
                        f"idle_timeout_s={self.idle_timeout_s}; are rollout workers running? raise idle_timeout_s"
                    )
                time.sleep(_POLL_S)
            served += 1
            yield item
