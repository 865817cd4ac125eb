"""A trainer rank's share of a sharded push (see docs/sharded.md): the same plan on every rank.

Rank 0 hands its :class:`~lightning_wsync._control.shards.Shares` to its sender; every other
rank writes its share into a ring of its own
(:func:`~lightning_wsync._planes.open.open_share_writer`).
"""

from __future__ import annotations

from torch import nn

from lightning_wsync._control.host import host_id
from lightning_wsync._control.manifest import build_manifest, select_tensors
from lightning_wsync._control.shards import Shares, plan_shards, share_sources
from lightning_wsync.config import SenderConfig


def prepare_shares(module: nn.Module, config: SenderConfig, rank: int, world: int) -> Shares:
    """This rank's :class:`Shares` of ``module``; the plan is the same on every rank.

    Raises:
        ValueError: a tensor placed in a way a sharded push cannot take (named, with its placement).
    """
    tensors = select_tensors(module, config.include, config.exclude)
    if not tensors:
        raise ValueError(
            f"WeightSyncCallback: include={config.include!r} exclude={config.exclude!r} select no tensor; "
            f"loosen the patterns"
        )
    layout = build_manifest(tensors, config.wire_dtype, config.bucket_bytes)
    plan = plan_shards(tensors, layout, world, config.bucket_bytes)
    ordered = [tensors[e.name] for e in layout.entries]
    sources = share_sources(plan, rank, layout, ordered)
    return Shares(rank, plan, layout, plan.share_layout(rank, layout), sources, host_id())
