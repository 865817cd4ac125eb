"""What each trainer rank's share of a version is, for a sharded push.

A sharded push splits a version (a :class:`~lightning_wsync._control.manifest.Manifest`)
into one *share* per trainer rank. A share is a list of :class:`Piece`: a run of elements
``[start, end)`` of one tensor, flattened. FSDP2 parameters (DTensors sharded on dim 0
over a 1-D mesh) give each rank the rows it holds; every other tensor is replicated on
every rank (DDP, or FSDP2's buffers) and is cut into runs so that each rank's share holds
about ``1/world`` of the bytes. A share is laid out as a manifest of its own (one entry per
piece), so the snapshot ring, buckets and checksums work on it unchanged.

Receivers get the :class:`ShardPlan` and reassemble whole tensors: every element of every
tensor is in exactly one piece, so the bytes equal those of a full gather.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lightning_wsync._control.manifest import Manifest, build_manifest

_MIN_CUT_BYTES = 1 << 20  # a replicated tensor below this goes whole to one rank


class Piece(NamedTuple):
    """Elements ``[start, end)`` of the flattened entry ``entry`` of the full layout."""

    entry: int
    start: int
    end: int


@dataclass(frozen=True)
class ShardPlan:
    """Each trainer rank's pieces (``shares[rank]``), the segment its ring lives in and its host."""

    shares: tuple[tuple[Piece, ...], ...]
    bucket_bytes: int
    segments: tuple[str, ...] = ()  # one per rank, filled in once every rank made its ring
    hosts: tuple[str, ...] = ()  # each rank's host id (empty: every rank on the sender's host)

    @property
    def world(self) -> int:
        return len(self.shares)

    def share_layout(self, rank: int, layout: Manifest) -> Manifest:
        """Rank ``rank``'s share as a manifest of its own: one flat entry per piece."""
        share = self.shares[rank]
        return build_manifest(_piece_tensors(share, layout), _wire(layout, share), self.bucket_bytes)

    def share_layouts(self, layout: Manifest) -> list[Manifest]:
        return [self.share_layout(rank, layout) for rank in range(self.world)]

    def with_segments(self, segments: Sequence[str], hosts: Sequence[str] | None = None) -> ShardPlan:
        """The plan with each rank's ring named (and, given ``hosts``, each rank's host id)."""
        hosts = self.hosts if hosts is None else tuple(hosts)
        if len(segments) != self.world or len(hosts) not in (0, self.world):
            raise ValueError(f"ShardPlan: {len(segments)} segment names and {len(hosts)} hosts for {self.world} ranks")
        return ShardPlan(self.shares, self.bucket_bytes, tuple(segments), tuple(hosts))

    def rank_hosts(self, default: str) -> tuple[str, ...]:
        """Each rank's host id; ``default`` (the sender's host) for a plan that names none."""
        return self.hosts or (default,) * self.world

    def to_json(self) -> str:
        shares = [[list(p) for p in share] for share in self.shares]
        return json.dumps({"shares": shares, "bucket_bytes": self.bucket_bytes, "segments": list(self.segments),
                           "hosts": list(self.hosts)}, separators=(",", ":"))  # fmt: skip

    @classmethod
    def from_json(cls, text: str | bytes) -> ShardPlan:
        raw = json.loads(text)
        shares = tuple(tuple(Piece(int(e), int(a), int(b)) for e, a, b in share) for share in raw["shares"])
        hosts = tuple(str(h) for h in raw.get("hosts", ()))
        return cls(shares, int(raw["bucket_bytes"]), tuple(str(s) for s in raw["segments"]), hosts)

    def check(self, layout: Manifest) -> None:
        """Every element of every entry in exactly one piece (a plan from the store: checked)."""
        covered: dict[int, list[tuple[int, int]]] = {}
        for share in self.shares:
            for p in share:
                if not 0 <= p.entry < len(layout.entries) or not 0 <= p.start <= p.end:
                    raise ValueError(f"piece {tuple(p)!r} does not fit the layout")
                covered.setdefault(p.entry, []).append((p.start, p.end))
        for i, e in enumerate(layout.entries):
            runs = sorted(covered.get(i, []))
            numel = _numel(e.shape)
            at = 0
            for a, b in runs:
                if a != at:
                    raise ValueError(f"tensor {e.name!r}: elements [{at}, {a}) are in no share, or in two")
                at = b
            if at != numel and numel:
                raise ValueError(f"tensor {e.name!r}: elements [{at}, {numel}) are in no share")


def plan_shards(tensors: dict[str, torch.Tensor], layout: Manifest, world: int, bucket_bytes: int) -> ShardPlan:
    """Split ``layout`` (made from ``tensors``) into ``world`` shares; the same on every rank.

    Raises:
        ValueError: a DTensor placed other than ``Shard(0)`` on a 1-D mesh of every rank, or
            whose local rows are not torch.chunk's (names it and its placement).
    """
    shares: list[list[Piece]] = [[] for _ in range(world)]
    load = [0] * world
    replicated: list[int] = []
    for i, e in enumerate(layout.entries):
        t = tensors[e.name]
        rows = _sharded_rows(e.name, t, world)
        if rows is None:
            replicated.append(i)
            continue
        per_row = _numel(e.shape[1:])
        for rank, (a, b) in enumerate(rows):
            if b > a:
                shares[rank].append(Piece(i, a * per_row, b * per_row))
                load[rank] += (b - a) * per_row * e.wire_dtype.itemsize
    total = sum(load) + sum(layout.entries[i].nbytes for i in replicated)
    room = [total // world - load[r] for r in range(world)]
    rank = 0
    for i in replicated:
        e = layout.entries[i]
        numel, size = _numel(e.shape), e.wire_dtype.itemsize
        cuttable = e.nbytes >= _MIN_CUT_BYTES and tensors[e.name].is_contiguous()
        start = 0
        while True:
            while rank < world - 1 and room[rank] <= 0:
                rank += 1
            last = rank == world - 1 or not cuttable
            end = numel if last else min(numel, start + max(1, -(-room[rank] // size)))
            shares[rank].append(Piece(i, start, end))
            room[rank] -= (end - start) * size
            start = end
            if start >= numel:
                break
    return ShardPlan(tuple(tuple(sorted(s)) for s in shares), bucket_bytes)


def _sharded_rows(name: str, t: torch.Tensor, world: int) -> list[tuple[int, int]] | None:
    """Each rank's rows of a DTensor sharded on dim 0 (torch.chunk's split); None: replicated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return None
    placements = tuple(t.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return None
    mesh = t.device_mesh
    if mesh.size() == 1:
        return None  # a mesh of one rank: every rank holds the whole tensor (as DDP would)
    if mesh.ndim != 1 or len(placements) != 1 or type(placements[0]) is not Shard or placements[0].dim != 0:
        raise ValueError(
            f"sharded push: tensor {name!r} has placements {placements!r} on a {mesh.ndim}-D mesh; only Shard(0) "
            f"on a 1-D mesh (FSDP2's fully_shard) or Replicate() is supported. Exclude it (exclude=[{name!r}]) "
            f"or push unsharded (sharded=False gathers the full weights on rank 0)"
        )
    if mesh.size() != world:
        raise ValueError(
            f"sharded push: tensor {name!r} is sharded over {mesh.size()} ranks, but the trainer has {world}; "
            f"shard over the whole data-parallel group, or push unsharded (sharded=False)"
        )
    if mesh.get_local_rank() != torch.distributed.get_rank():
        raise ValueError(
            f"sharded push: tensor {name!r} is sharded over a mesh where this rank (global rank "
            f"{torch.distributed.get_rank()}) is number {mesh.get_local_rank()}; shard over every trainer rank in "
            f"order, or push unsharded (sharded=False)"
        )
    n = t.shape[0]
    chunk = -(-n // world)
    rows = [(min(r * chunk, n), min((r + 1) * chunk, n)) for r in range(world)]
    local = t.to_local()
    mine = rows[mesh.get_local_rank()]
    if local.shape[0] != mine[1] - mine[0] or not local.is_contiguous():
        raise ValueError(
            f"sharded push: tensor {name!r} ({placements!r}, global shape {tuple(t.shape)}) holds "
            f"{tuple(local.shape)} here, not rows [{mine[0]}, {mine[1]}) as torch.chunk splits them (uneven or "
            f"strided sharding); exclude it (exclude=[{name!r}]) or push unsharded (sharded=False)"
        )
    return rows


def share_sources(plan: ShardPlan, rank: int, layout: Manifest, ordered: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's flat source views, one per piece of its share (``ordered``: the tensors in layout order)."""
    from torch.distributed.tensor import DTensor

    out: list[torch.Tensor] = []
    for p in plan.shares[rank]:
        t = ordered[p.entry].detach()
        if isinstance(t, DTensor) and not all(type(x).__name__ == "Replicate" for x in t.placements):
            local = t.to_local()
            out.append(local.view(-1))  # the whole local shard: its rows are this piece
        else:
            if isinstance(t, DTensor):
                t = t.to_local()
            out.append(t.reshape(-1)[p.start : p.end])  # a copy only for a non-contiguous tensor, given whole
    return out


def piece_views(plan: ShardPlan, rank: int, layout: Manifest, ordered: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The receiver's flat destinations of rank ``rank``'s pieces (``ordered``: whole, contiguous tensors)."""
    return [ordered[p.entry].detach().view(-1)[p.start : p.end] for p in plan.shares[rank]]


def _piece_tensors(share: Sequence[Piece], layout: Manifest) -> dict[str, torch.Tensor]:
    """Placeholders shaped like each piece, for :func:`build_manifest` (meta: no memory)."""
    out: dict[str, torch.Tensor] = {}
    for p in share:
        e = layout.entries[p.entry]
        out[f"{e.name}[{p.start}:{p.end}]"] = torch.empty(p.end - p.start, dtype=e.dtype, device="meta")
    return out


def _wire(layout: Manifest, share: Sequence[Piece]) -> torch.dtype | None:
    """The wire dtype of the layout's floating entries (one for all, as the sender casts)."""
    for p in share:
        e = layout.entries[p.entry]
        if e.dtype.is_floating_point and e.wire_dtype != e.dtype:
            return e.wire_dtype
    return None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class Shares:
    """One rank's part of a sharded push: the plan, the full layout, its share and its sources."""

    rank: int
    plan: ShardPlan
    layout: Manifest  # the whole version, as receivers bind it
    share: Manifest  # this rank's bytes
    sources: list[torch.Tensor]  # this rank's tensors (local shards, or slices of replicated ones), one per piece
    host: str = ""  # this rank's host id (the relay serves the hosts other than each rank's own)
