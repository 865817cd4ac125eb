"""Which path a fit pushes by (``sharded="auto"`` by default, True, False), and the reason said once."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from lightning_wsync._push.shard_choice import why_unsharded
from lightning_wsync.callback import WeightSyncCallback
from lightning_wsync.config import CallbackConfig


def _trainer(strategy: Any, world: int, rank: int = 0) -> Any:
    return SimpleNamespace(strategy=strategy, world_size=world, is_global_zero=rank == 0)


def _why(world: int, strategy: Any, **options: Any) -> str | None:
    sync = WeightSyncCallback(every_n_steps=1, job="j", **options)
    return why_unsharded(sync.config.sharded, sync.sender_config, strategy, world)


def test_auto_is_the_default_everywhere_the_option_lives() -> None:
    assert WeightSyncCallback(every_n_steps=1, job="j").config.sharded == "auto"
    assert CallbackConfig(every_n_steps=1).sharded == "auto"
    with pytest.raises(TypeError, match=r"sharded='yes' must be 'auto', True or False"):
        WeightSyncCallback(every_n_steps=1, job="j", sharded="yes")


@pytest.mark.parametrize(
    ("world", "strategy", "options", "why"),
    [
        (2, DDPStrategy(), {}, None),
        (4, ModelParallelStrategy(), {}, None),
        (2, DDPStrategy(), {"transport": "shm"}, None),
        (2, DDPStrategy(), {"cross_host": "chain"}, None),
        (1, SingleDeviceStrategy(), {}, "one trainer rank: its share would be the whole version"),
        (1, DDPStrategy(), {}, "one trainer rank: its share would be the whole version"),
        (2, FSDPStrategy(), {}, "FSDPStrategy's flat parameters cannot be split by tensor, so rank 0 gathers"),
        (2, DDPStrategy(), {"transport": "gloo"}, "transport='gloo': a sharded push goes through shared memory"),
        (2, DDPStrategy(), {"cross_host": "star"}, "cross_host='star': a sharded push reaches other hosts only"),
        (2, ModelParallelStrategy(), {"cross_host": "tree"}, None),  # trees per share stream
        (2, DDPStrategy(), {"transport": "nixl"}, None),  # each share stream's hops are NIXL READs
        (2, DDPStrategy(), {"transport": "nixl", "cross_host": "star"}, "cross_host='star': a sharded push"),
        (2, DDPStrategy(), {"sharded": False}, "sharded=False"),
        (2, DDPStrategy(), {"sharded": True, "transport": "gloo"}, None),  # forced: the sender refuses it, naming why
    ],
)
def test_auto_shards_several_ranks_under_ddp_and_fsdp2_and_says_why_not(world, strategy, options, why) -> None:
    got = _why(world, strategy, **options)
    assert got == why if why is None else got is not None and got.startswith(why), got


def test_sharded_true_under_fsdp1_is_refused() -> None:
    with pytest.raises(ValueError, match=r"sharded=True needs DDP or ModelParallelStrategy"):
        _why(2, FSDPStrategy(), sharded=True)


def test_the_reason_is_said_once_by_rank_0_only(caplog: pytest.LogCaptureFixture) -> None:
    sync = WeightSyncCallback(every_n_steps=1, job="j", transport="gloo")
    caplog.set_level(logging.INFO, logger="lightning_wsync.callback")
    for rank in (1, 0, 0):  # rank 1, then rank 0 in two fits
        trainer = _trainer(DDPStrategy(), 2, rank)
        sync._unsharded_reason = why_unsharded(sync.config.sharded, sync.sender_config, trainer.strategy, 2)
        sync._say_path(trainer)
    said = [r for r in caplog.records if "unsharded push" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in said] == [(
        logging.WARNING,
        "WeightSyncCallback: unsharded push (rank 0 sends every version): transport='gloo': a sharded push goes "
        "through shared memory ('auto', 'shm' or 'nixl')",
    )]  # fmt: skip
