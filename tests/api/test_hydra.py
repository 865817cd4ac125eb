"""The Hydra configs in conf/: composition, command-line overrides, validation at start-up."""

from __future__ import annotations

import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_wsync import ReceiverConfig, SenderConfig
from lightning_wsync.callback import WeightSyncCallback
from lightning_wsync.config import CallbackConfig, register_configs

pytestmark = pytest.mark.timeout(60)
CONF = str(Path(__file__).resolve().parents[2] / "conf")


def load(app, overrides=()):
    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=CONF):
        return compose(app, overrides=list(overrides))


def test_trainer_app_builds_the_callback_with_overrides():
    cfg = load("trainer", ["wsync.every_n_steps=5", "wsync.max_version_lag=2", "wsync.include=[policy.*]",
                           "wsync.store=127.0.0.1:29400", "wsync.job=exp1", "trainer.max_steps=1000"])  # fmt: skip
    callback = instantiate(cfg.wsync)
    assert isinstance(callback, WeightSyncCallback)
    assert callback.config.every_n_steps == 5 and callback.config.max_version_lag == 2
    assert callback.config.module == "policy"  # from conf/trainer.yaml
    assert callback.config.sender_config() == SenderConfig(job="exp1", include=["policy.*"])
    assert type(callback.config.include) is list  # _convert_=all: no ListConfig leaks into the sender

    trainer = pl.Trainer(**cfg.trainer, callbacks=[callback], logger=False, enable_checkpointing=False)
    assert callback in trainer.callbacks and trainer.max_steps == 1000


def test_config_object_round_trip():
    cfg = load("trainer", ["wsync.every_n_steps=7", "wsync.dtype=bfloat16"])
    obj = OmegaConf.to_object(cfg.wsync)
    assert isinstance(obj, CallbackConfig) and obj.every_n_steps == 7 and obj.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("wsync.every_n_steps=0", r"every_n_steps=0 must be an int >= 1"),
        ("wsync.max_version_lag=-2", r"max_version_lag=-2 must be an int >= 0"),
        ("wsync.transport=udp", r"transport='udp' is unknown; choose one of"),
        ("wsync.dtype=int8", r"dtype='int8' is not supported"),
        ("wsync.module=policy..x", r"module='policy..x' must be an attribute path"),
    ],
)
def test_invalid_values_fail_at_start_up(override, match):
    cfg = load("trainer", [override])
    with pytest.raises(InstantiationException, match=match):
        instantiate(cfg.wsync)
    with pytest.raises(ValueError, match=match):
        OmegaConf.to_object(cfg.wsync)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("wsync.every_n_steps=often", r"Value 'often' of type 'str' could not be converted to Integer"),
        ("wsync.bucket_mb=big", r"Value 'big' of type 'str' could not be converted to Float"),
        ("wsync.every_n_stepz=3", r"Key 'every_n_stepz' not in 'CallbackConfig'"),
    ],
)
def test_wrong_types_and_unknown_keys_fail_at_composition(override, match):
    with pytest.raises(ConfigCompositionException) as info:
        load("trainer", [override])
    text = f"{info.value}\n{info.value.__cause__}"  # Hydra names the override; OmegaConf the constraint
    assert override in text and re.search(match, text), text


def test_missing_every_n_steps_is_required():
    register_configs()
    cfg = OmegaConf.structured(CallbackConfig)
    assert OmegaConf.is_missing(cfg, "every_n_steps")


def test_rollout_app_builds_a_receiver_config():
    cfg = load("rollout", ["wsync.name=actor-3", "store=127.0.0.1:29400"])
    receiver_config = OmegaConf.to_object(cfg.wsync)
    assert receiver_config == ReceiverConfig(name="actor-3")
    assert cfg.store == "127.0.0.1:29400" and cfg.rollout.first_version_timeout_s == 120.0
    with pytest.raises(ValueError, match=r"heartbeat_s=-1.0 must be a number > 0"):
        OmegaConf.to_object(load("rollout", ["wsync.heartbeat_s=-1"]).wsync)
    assert OmegaConf.to_object(load("rollout", ["wsync.apply=swap"]).wsync).apply == "swap"
    with pytest.raises(ValueError, match=r"apply='move' must be one of \('copy', 'swap'\)"):
        OmegaConf.to_object(load("rollout", ["wsync.apply=move"]).wsync)
    with pytest.raises(ValueError, match=r"name='a/b' must be non-empty and contain no '/'"):
        OmegaConf.to_object(load("rollout", ["wsync.name=a/b"]).wsync)
