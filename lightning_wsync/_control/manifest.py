"""What a version is: the tensor table, its byte layout and its bucket ranges.

A :class:`Manifest` is fixed for a sender's lifetime (one per sender epoch) and is
published once as JSON; each version only adds its number and snapshot sequence.
Nothing here is ever pickled: the wire format is JSON plus raw tensor bytes.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import xxhash
from torch import nn

from lightning_wsync.errors import WeightSyncSchemaError

_ALIGN = 64  # bytes; keeps every tensor view aligned for any dtype and for SIMD copies


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the published state: where its bytes sit in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # dtype in the trainer's module
    wire_dtype: torch.dtype  # dtype in the buffer (differs when the sender casts)
    offset: int
    nbytes: int

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This tensor's bytes in ``buffer`` (a flat uint8 tensor), typed and shaped."""
        return buffer[self.offset : self.offset + self.nbytes].view(self.wire_dtype).view(self.shape)


@dataclass(frozen=True)
class Manifest:
    """Tensor table plus bucket ranges of one sender epoch."""

    entries: tuple[TensorEntry, ...]
    buckets: tuple[tuple[int, int], ...]  # [start, end) byte ranges covering the entries
    total_bytes: int

    def to_json(self) -> str:
        return json.dumps(
            {
                "tensors": [
                    [e.name, list(e.shape), dtype_to_name(e.dtype), dtype_to_name(e.wire_dtype), e.offset, e.nbytes]
                    for e in self.entries
                ],
                "buckets": [list(b) for b in self.buckets],
                "total_bytes": self.total_bytes,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        raw = json.loads(text)
        entries = tuple(
            TensorEntry(name, tuple(shape), dtype_from_name(dt), dtype_from_name(wdt), off, nb)
            for name, shape, dt, wdt, off, nb in raw["tensors"]
        )
        buckets = tuple((int(a), int(b)) for a, b in raw["buckets"])
        return cls(entries=entries, buckets=buckets, total_bytes=int(raw["total_bytes"]))

    def check_module(self, tensors: dict[str, torch.Tensor], receiver: str) -> None:
        """Raise :class:`WeightSyncSchemaError` at the first difference from ``tensors``."""
        for e in self.entries:
            mine = tensors.get(e.name)
            if mine is None:
                raise WeightSyncSchemaError(
                    f"receiver {receiver!r}: the sender publishes tensor {e.name!r} but the receiving "
                    f"module has no such parameter or buffer; build the rollout module with the same "
                    f"architecture, or narrow the sender with include=/exclude="
                )
            if tuple(mine.shape) != e.shape:
                raise WeightSyncSchemaError(
                    f"receiver {receiver!r}: tensor {e.name!r} has shape {tuple(mine.shape)!r} here but "
                    f"{e.shape!r} on the sender; build the rollout module with the trainer's configuration"
                )
            if mine.dtype not in (e.dtype, e.wire_dtype):  # a bf16 rollout module takes a bf16 push as is
                raise WeightSyncSchemaError(
                    f"receiver {receiver!r}: tensor {e.name!r} has dtype {mine.dtype} here but {e.dtype} "
                    f"on the sender; cast the rollout module (e.g. module.to({e.dtype})) before "
                    f"creating the WeightReceiver"
                )
        extra = sorted(set(tensors) - {e.name for e in self.entries})
        if extra:
            raise WeightSyncSchemaError(
                f"receiver {receiver!r}: tensor {extra[0]!r} (and {len(extra) - 1} more) is selected here "
                f"but not published by the sender; use the same include=/exclude= on both sides"
            )


def select_tensors(
    module: nn.Module, include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> dict[str, torch.Tensor]:
    """The module's state (parameters and persistent buffers) filtered by glob patterns.

    Tied tensors appear once, under their first name, so both sides agree.
    """
    selected: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if include and not any(fnmatch.fnmatchcase(name, p) for p in include):
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in exclude):
            continue
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        selected[name] = tensor
    return selected


def build_manifest(
    tensors: dict[str, torch.Tensor], wire_dtype: torch.dtype | None, bucket_bytes: int
) -> Manifest:
    """Lay the tensors out back to back, aligned, grouped into buckets of about ``bucket_bytes``."""
    entries: list[TensorEntry] = []
    buckets: list[tuple[int, int]] = []
    offset = 0
    bucket_start = 0
    for name, t in tensors.items():
        wdt = wire_dtype if (wire_dtype is not None and t.is_floating_point()) else t.dtype
        nbytes = t.numel() * _itemsize(wdt)
        if offset > bucket_start and offset + nbytes - bucket_start > bucket_bytes:
            buckets.append((bucket_start, offset))
            bucket_start = offset
        entries.append(TensorEntry(name, tuple(t.shape), t.dtype, wdt, offset, nbytes))
        offset = _align(offset + nbytes)
    if offset > bucket_start:
        buckets.append((bucket_start, offset))
    return Manifest(entries=tuple(entries), buckets=tuple(buckets), total_bytes=max(offset, _ALIGN))


def entry_views(layout: Manifest, buffer: torch.Tensor) -> list[torch.Tensor]:
    """Every entry's typed, shaped view of ``buffer``, in layout order.

    Worth computing once per buffer: making ~200 views costs about as much as copying
    16 MiB.
    """
    return [e.view(buffer) for e in layout.entries]


def copy_tensors(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i] <- src[i]`` in place, casting; one fused call when every tensor is on the CPU.

    The per-tensor loop costs ~10 us of dispatch per tensor, as much as the copy itself
    for a small policy; the fused call is as fast as one memcpy of the same bytes.
    """
    with torch.no_grad():
        if dst and all(t.device.type == "cpu" for t in dst) and all(t.device.type == "cpu" for t in src):
            torch._foreach_copy_(list(dst), list(src))
            return
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)


def copy_into(layout: Manifest, buffer: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
    """Snapshot ``tensors`` (in layout order) into ``buffer``, casting to the wire dtype."""
    copy_tensors(entry_views(layout, buffer), list(tensors))


def copy_out(layout: Manifest, buffer: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
    """Write ``buffer``'s bytes into ``tensors`` in place (references held elsewhere stay valid)."""
    copy_tensors(list(tensors), entry_views(layout, buffer))


def bind_views(layout: Manifest, buffer: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
    """Point ``tensors`` at their bytes in ``buffer`` (same tensor objects, new storage)."""
    with torch.no_grad():
        for e, t in zip(layout.entries, tensors):
            t.data = e.view(buffer)


def checksum(buffer: torch.Tensor, start: int, end: int) -> int:
    """xxh3-64 of bytes [start, end) of a CPU uint8 buffer (releases the GIL)."""
    return int(xxhash.xxh3_64_intdigest(buffer[start:end].numpy().data))


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtype_to_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncSchemaError(f"published layout names unknown dtype {name!r}; upgrade torch on this side")
    return dtype
