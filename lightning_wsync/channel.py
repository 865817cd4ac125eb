"""Experience from rollout workers back to the trainer: a small bounded queue on the store.

Each item is a dict of tensors tagged with the weights version that produced it. The
queue lives on the control-plane store (``channel/<name>/queue`` under the job), so it
suits the modest rates of an actor-learner loop (episodes, not raw frames at GB/s).
Items are encoded as a JSON header plus raw tensor bytes; nothing is unpickled.

Rollout side::

    writer = ExperienceWriter()                      # store and job from WSYNC_* env
    writer.put({"obs": obs, "actions": actions}, version=receiver.version)

Trainer side (every DDP rank pops its own share)::

    loader = DataLoader(ExperienceReader(), batch_size=None)
    for item in loader:  # {"obs": ..., "actions": ..., "version": tensor(7)}
        ...
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from lightning_wsync._control import Control, connect_store, resolve_job
from lightning_wsync._manifest import _dtype_from_name, _dtype_name
from lightning_wsync.errors import WeightSyncStoreError, WeightSyncTimeoutError

VERSION_KEY = "version"
_POLL_S = 0.002
_HEADER = struct.Struct("<I")


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
        meta.append([name, _dtype_name(t.dtype), list(t.shape)])
    header = json.dumps({"version": int(version), "tensors": meta}, separators=(",", ":")).encode()
    return _HEADER.pack(len(header)) + header + b"".join(tensors)


def decode(raw: bytes) -> dict[str, torch.Tensor]:
    (n,) = _HEADER.unpack_from(raw)
    header = json.loads(raw[_HEADER.size : _HEADER.size + n])
    out: dict[str, torch.Tensor] = {}
    offset = _HEADER.size + n
    for name, dtype_name, shape in header["tensors"]:
        dtype = _dtype_from_name(dtype_name)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = bytearray(raw[offset : offset + nbytes])
        out[name] = torch.frombuffer(buf, dtype=dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
        offset += nbytes
    out[VERSION_KEY] = torch.tensor(int(header["version"]), dtype=torch.int64)
    return out


class _Queue:
    """A bounded FIFO on the store: slot reservation counter plus the store's queue."""

    def __init__(self, control: Control, name: str, *, capacity: int) -> None:
        self._ctl = control
        self._queue_key = f"channel/{name}/queue"
        self._slots_key = f"channel/{name}/slots"
        self.capacity = capacity

    def try_push(self, payload: bytes) -> bool:
        try:
            if self._ctl.add(self._slots_key, 1) > self.capacity:
                self._ctl.add(self._slots_key, -1)
                return False
            self._ctl.store.queue_push(self._queue_key, payload)
        except RuntimeError as exc:
            raise self._lost(exc) from exc
        return True

    def try_pop(self) -> bytes | None:
        try:
            payload = self._ctl.store.queue_pop(self._queue_key, block=False)
            self._ctl.add(self._slots_key, -1)
        except dist.QueueEmptyError:
            return None
        except RuntimeError as exc:
            raise self._lost(exc) from exc
        return bytes(payload)

    def _lost(self, exc: RuntimeError) -> WeightSyncStoreError:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return WeightSyncStoreError(f"experience channel {self._queue_key!r}: the store is unreachable ({first})")

    def __len__(self) -> int:
        return int(self._ctl.store.queue_len(self._queue_key))


def _check(owner: str, channel: str, capacity: int, timeout_s: float, timeout_name: str = "timeout_s") -> None:
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
    """

    def __init__(
        self,
        store: dist.Store | str | None = None,
        job: str | None = None,
        *,
        channel: str = "experience",
        capacity: int = 64,
        timeout_s: float = 30.0,
    ) -> None:
        _check("ExperienceWriter", channel, capacity, timeout_s)
        handle = connect_store(store, serve=False, timeout_s=timeout_s, owner="ExperienceWriter")
        control = Control(handle.store, resolve_job(job, "ExperienceWriter"))
        self._queue = _Queue(control, channel, capacity=capacity)
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
    and ends after ``max_items`` if given. The store connection opens on first
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
    ) -> None:
        _check("ExperienceReader", channel, 1, idle_timeout_s, "idle_timeout_s")
        self._store = store
        self._job = job
        self._channel = channel
        self.idle_timeout_s = idle_timeout_s
        self.max_items = max_items

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        handle = connect_store(self._store, serve=False, timeout_s=self.idle_timeout_s, owner="ExperienceReader")
        queue = _Queue(Control(handle.store, resolve_job(self._job, "ExperienceReader")), self._channel, capacity=0)
        served = 0
        while self.max_items is None or served < self.max_items:
            deadline = time.monotonic() + self.idle_timeout_s
            while (payload := queue.try_pop()) is None:
                if time.monotonic() >= deadline:
                    raise WeightSyncTimeoutError(
                        f"ExperienceReader: nothing arrived on channel {self._channel!r} for "
                        f"idle_timeout_s={self.idle_timeout_s}; are rollout workers running? raise idle_timeout_s"
                    )
                time.sleep(_POLL_S)
            served += 1
            yield decode(payload)
