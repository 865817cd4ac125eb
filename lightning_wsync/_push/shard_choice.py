"""Sharded or not: which path a fit of the callback pushes by (``sharded="auto"``, True, False) and why,
and, when sharded, every rank's share cut and gathered (docs/sharded.md; tests/e2e/test_shard_choice.py)."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from torch import nn

from lightning_wsync._control.shards import Shares
from lightning_wsync._planes.open import ShareWriter, open_share_writer
from lightning_wsync._push.shares import prepare_shares
from lightning_wsync.config import SenderConfig
from lightning_wsync.errors import WeightSyncError


def why_unsharded(setting: bool | str, cfg: SenderConfig, strategy: Strategy, world_size: int) -> str | None:
    """None: this fit pushes sharded; else why not (``sharded="auto"``, or False). The same on every rank."""
    if setting is False:
        return "sharded=False"
    if world_size <= 1:
        return "one trainer rank: its share would be the whole version"
    if isinstance(strategy, FSDPStrategy):
        if setting is True:
            raise ValueError(
                "WeightSyncCallback: sharded=True needs DDP or ModelParallelStrategy (FSDP2, DTensor shards); "
                "FSDPStrategy's flat parameters cannot be split by tensor: use sharded=False (rank 0 gathers)"
            )
        return ("FSDPStrategy's flat parameters cannot be split by tensor, so rank 0 gathers them; "
                "ModelParallelStrategy with fully_shard (FSDP2) pushes sharded")  # fmt: skip
    if setting is True:
        return None  # the sender refuses settings it cannot serve, naming them
    if not isinstance(strategy, (DDPStrategy, ModelParallelStrategy)):
        return f"strategy {type(strategy).__name__} is neither DDP nor ModelParallelStrategy (FSDP2)"
    if cfg.transport not in ("auto", "shm", "nixl"):
        return f"transport={cfg.transport!r}: a sharded push goes through shared memory ('auto', 'shm' or 'nixl')"
    if cfg.cross_host == "star":
        return ("cross_host='star': a sharded push reaches other hosts only by relaying each rank's share, "
                "never one link per receiver")  # fmt: skip
    return None


def start_shares(
    target: nn.Module, cfg: SenderConfig, rank: int, world: int, *, auto: bool
) -> tuple[Shares | None, ShareWriter | None, str | None]:
    """Every rank's share and, on ranks other than 0, its ring (the writer); rank 0 learns every ring's
    name. A collective. Under ``sharded="auto"`` (``auto``), when some rank cannot cut its share:
    ``(None, None, the reason)``; otherwise that raises (this rank's ring closed first)."""
    writer: ShareWriter | None = None
    error: str | None = None
    name = host = ""
    try:
        shares = prepare_shares(target, cfg, rank, world)
        host = shares.host
        if rank != 0:
            writer = open_share_writer(shares, cfg)
            name = writer.name
    except Exception as exc:  # every rank must reach the gather below, or the others hang in it
        error = f"{type(exc).__name__}: {exc}"
    gathered: list[tuple[str, str, str | None]] = [("", "", None)] * world
    dist.all_gather_object(gathered, (name, host, error))
    failed = [(r, e) for r, (_, _, e) in enumerate(gathered) if e is not None]
    if failed and writer is not None:  # every rank sees the same list: all fall back (or all raise)
        writer.close()
    if failed and auto:
        return None, None, f"trainer rank {failed[0][0]} cannot cut its share: {failed[0][1]}"
    if failed:
        raise WeightSyncError(f"WeightSyncCallback: sharded push: trainer rank {failed[0][0]} could not "
                              f"prepare its share: {failed[0][1]}")  # fmt: skip
    plan = shares.plan.with_segments([n for n, _, _ in gathered], [h for _, h, _ in gathered])
    return dataclasses.replace(shares, plan=plan), writer, None
