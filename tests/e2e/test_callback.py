"""WeightSyncCallback on a real Lightning Trainer (CPU), with real receivers."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _lightning_workers import (
    PolicyModule,
    digest,
    loader,
    make_policy,
    next_message,
    receiver_main,
)
from _spawn import CTX
from conftest import free_port
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_wsync import SenderConfig, WeightReceiver
from lightning_wsync.callback import WeightSyncCallback
from lightning_wsync.testing.trainers import RecordingLogger, trainer_kwargs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store(port):
    """A control-plane store hosted by the test, outliving each Trainer (as a torchrun agent's would)."""
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield f"127.0.0.1:{port}"
    del server


def fit(tmp_path, callback, max_steps, ckpt_path=None, callbacks=(), **trainer_options):
    logger = RecordingLogger()
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=max_steps, logger=logger,
                                          callbacks=[callback, *callbacks], **trainer_options))  # fmt: skip
    model = PolicyModule()
    trainer.fit(model, train_dataloaders=loader(), ckpt_path=ckpt_path)
    return logger, model


# -- construction ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every_n_steps": 0}, ValueError, r"every_n_steps=0 must be an int >= 1"),
        ({"every_n_steps": 2.5}, ValueError, r"every_n_steps=2.5 must be an int >= 1"),
        ({"every_n_steps": 1, "module": "a..b"}, ValueError, r"module='a..b' must be an attribute path"),
        ({"every_n_steps": 1, "max_version_lag": -1}, ValueError, r"max_version_lag=-1 must be an int >= 0"),
        ({"every_n_steps": 1, "bucket_mb": 0}, ValueError, r"bucket_mb=0 must be a number > 0"),
        ({"every_n_steps": 1, "transport": "udp"}, ValueError, r"transport='udp' is unknown"),
        ({"every_n_steps": 1, "store": 29400}, TypeError, r"store=29400 must be 'host:port'"),
        (
            {"every_n_steps": 1, "sender": SenderConfig(), "bucket_mb": 8.0},
            TypeError,
            r"got sender=SenderConfig\(...\) and the options \['bucket_mb'\]; pass one or the other",
        ),
        (  # an option passed with its default value is noticed too
            {"every_n_steps": 1, "sender": SenderConfig(), "timeout_s": 30.0},
            TypeError,
            r"got sender=SenderConfig\(...\) and the options \['timeout_s'\]; pass one or the other",
        ),
        ({"every_n_steps": 1, "bucket_size": 3}, TypeError, r"unexpected keyword argument 'bucket_size'; the options"),
        ({"every_n_steps": 1, "include": None}, TypeError, r"include=None must be a list of glob patterns"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        WeightSyncCallback(**kwargs)


def test_sender_config_and_state_dict():
    cb = WeightSyncCallback(every_n_steps=3, job="a", sender=SenderConfig(bucket_mb=8.0, dtype="bfloat16", secret="s"))
    assert cb.sender_config == SenderConfig(job="a", bucket_mb=8.0, dtype="bfloat16", secret="s")
    assert cb.config.bucket_mb == 8.0 and cb.config.job == "a"
    flat = WeightSyncCallback(every_n_steps=3, job="b", bucket_mb=4.0, include=["policy.*"])
    assert flat.sender_config == SenderConfig(job="b", bucket_mb=4.0, include=["policy.*"])
    assert cb.state_dict() == {"last_pushed_version": None}
    cb.load_state_dict({"last_pushed_version": 40})
    assert cb.last_pushed_version == 40 and cb.state_dict() == {"last_pushed_version": 40}
    other = WeightSyncCallback(every_n_steps=3, job="b", module="policy")
    assert cb.state_key != other.state_key


def test_unknown_module_lists_children(tmp_path, store):
    cb = WeightSyncCallback(every_n_steps=1, module="policy.head", store=store, job="nomod")
    listing = r"module='policy.head': policy has no submodule 'head'; its submodules are \['0', '1', '2'\]"
    with pytest.raises(ValueError, match=listing):
        fit(tmp_path, cb, max_steps=1)
    cb = WeightSyncCallback(every_n_steps=1, module="actor", store=store, job="nomod")
    listing = r"PolicyModule has no submodule 'actor'; its submodules are \['critic', 'policy'\]"
    with pytest.raises(ValueError, match=listing):
        fit(tmp_path, cb, max_steps=1)


# -- when pushes happen ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("every", "accumulate", "max_steps", "expected"),
    [
        (3, 1, 10, [0, 3, 6, 9, 10]),  # max_steps not divisible: one more push at the end
        (2, 2, 6, [0, 2, 4, 6]),  # divisible: the end push is not repeated
        (4, 3, 5, [0, 4, 5]),  # accumulation: versions count optimizer steps
    ],
)
def test_push_steps(tmp_path, store, every, accumulate, max_steps, expected):
    cb = WeightSyncCallback(every_n_steps=every, store=store, job=f"steps{every}")
    logger, _ = fit(tmp_path, cb, max_steps=max_steps, accumulate_grad_batches=accumulate)
    assert logger.values("wsync/version") == expected
    assert [step for step, m in logger.rows if "wsync/version" in m] == expected  # logged at the push step
    assert cb.last_pushed_version == expected[-1]
    assert cb.sender is None  # closed at the end of training
    assert all(b == logger.values("wsync/bytes")[0] > 0 for b in logger.values("wsync/bytes"))


@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resume_continues_above_last_pushed(tmp_path, store, caplog):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    logger, _ = fit(tmp_path, WeightSyncCallback(every_n_steps=2, store=store, job="resume"), max_steps=6,
                    callbacks=[ckpt], enable_checkpointing=True)  # fmt: skip
    assert logger.values("wsync/version") == [0, 2, 4, 6]
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"

    # Same job: the store already holds version 6, so steps 4 (the checkpoint's) and 6 are skipped.
    with caplog.at_level(logging.INFO, logger="lightning_wsync.callback"):
        logger, _ = fit(tmp_path, WeightSyncCallback(every_n_steps=2, store=store, job="resume"), max_steps=10,
                        ckpt_path=path)  # fmt: skip
    assert logger.values("wsync/version") == [8, 10]
    assert "step 6 not pushed: version 6 is already published" in caplog.text

    # A new store (the job's record lost with it): the checkpoint's weights are version 4's,
    # published again at once for receivers of the new store; then above it.
    fresh_port = free_port()
    fresh = dist.TCPStore("127.0.0.1", fresh_port, is_master=True, wait_for_workers=False)
    cb = WeightSyncCallback(every_n_steps=2, store=f"127.0.0.1:{fresh_port}", job="resume")
    logger, _ = fit(tmp_path, cb, max_steps=10, ckpt_path=path)
    assert logger.values("wsync/version") == [4, 6, 8, 10]
    assert cb.last_pushed_version == 10
    del fresh


class _LateRestore(SingleDeviceStrategy):
    """Restores the checkpoint after on_fit_start, as FSDPStrategy and ModelParallelStrategy do."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


def _strategy(late: bool) -> dict[str, object]:
    return {"strategy": _LateRestore(torch.device("cpu"))} if late else {}


@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.parametrize("restore", ["before_fit_start", "after_fit_start"])
@pytest.mark.slow
def test_resumed_trainer_serves_a_late_receiver_at_once(tmp_path, store, children, restore):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    fit(tmp_path, WeightSyncCallback(every_n_steps=2, module="policy", store=store, job="late"), max_steps=6,
        callbacks=[ckpt], enable_checkpointing=True)  # fmt: skip
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    late = restore == "after_fit_start"

    # The trainer is relaunched with a fresh store; a rollout worker is already waiting there.
    fresh_port = free_port()
    fresh = dist.TCPStore("127.0.0.1", fresh_port, is_master=True, wait_for_workers=False)
    fresh_store = f"127.0.0.1:{fresh_port}"
    results = CTX.Queue()
    proc = CTX.Process(target=receiver_main, args=(fresh_store, "late", "r0", results), daemon=True)
    proc.start()
    children.track(proc.pid)
    next_message(results, "ready", timeout_s=60)
    cb = WeightSyncCallback(every_n_steps=2, module="policy", store=fresh_store, job="late", max_version_lag=0)
    logger, model = fit(tmp_path, cb, max_steps=8, ckpt_path=path, **_strategy(late))
    assert logger.values("wsync/version") == [4, 6, 8]
    assert next_message(results, "version", timeout_s=30)[2] == 4  # at once: before step 6 was trained
    assert logger.values("wsync/delivered")[0] == 1

    # The same store again (it holds 8): versions continue above it, never at or below.
    cb2 = WeightSyncCallback(every_n_steps=2, module="policy", store=fresh_store, job="late")
    logger, _ = fit(tmp_path, cb2, max_steps=12, ckpt_path=path, **_strategy(late))
    assert logger.values("wsync/version") == [10, 12]
    assert cb.last_pushed_version == 8
    proc.kill()
    del fresh


# -- delivery ------------------------------------------------------------------------------
@pytest.mark.slow
def test_receiver_gets_every_version_bit_exact(tmp_path, store, children):
    results = CTX.Queue()
    proc = CTX.Process(target=receiver_main, args=(store, "exact", "r0", results), daemon=True)
    proc.start()
    children.track(proc.pid)
    next_message(results, "ready", timeout_s=60)

    cb = WeightSyncCallback(every_n_steps=2, module="policy", store=store, job="exact", max_version_lag=0)
    logger, model = fit(tmp_path, cb, max_steps=5)
    versions, digests = [], []
    while not versions or versions[-1] < 5:
        msg = next_message(results, "version", timeout_s=30)
        versions.append(msg[2])
        digests.append(msg[3])
    assert versions == [0, 2, 4, 5]  # max_version_lag=0: each version is applied before the next push
    assert digests[-1] == digest(model.policy)
    assert len(set(digests)) == 4
    assert next_message(results, "closed", timeout_s=30)[2] == 5
    proc.join(timeout=30)
    assert proc.exitcode == 0
    # Reports of pushes 0, 2, 4 arrive at the following pushes, of 5 when the sender closes.
    assert logger.values("wsync/report_version") == [0, 2, 4, 5]
    assert logger.values("wsync/delivered") == [1, 1, 1, 1] and logger.values("wsync/failed") == [0, 0, 0, 0]
    assert logger.values("wsync/version_lag") == [0, 0, 0, 0]
    assert len(logger.values("wsync/lag_wait_s")) == 4


class _Clock(pl.Callback):
    """Placed before WeightSyncCallback: times the loop between the first and the last push."""

    def on_train_start(self, trainer, pl_module):
        self.started = time.monotonic()

    def on_train_end(self, trainer, pl_module):
        self.loop_s = time.monotonic() - self.started


@pytest.mark.parametrize(("max_version_lag", "timeout_s"), [(None, 1.0), (0, 0.5)])
def test_stalled_receiver_blocks_only_within_bounds(tmp_path, store, max_version_lag, timeout_s, caplog):
    """A receiver that never calls update() never acknowledges (shared-memory path)."""
    cb = WeightSyncCallback(every_n_steps=1, module="policy", store=store, job="stall", timeout_s=timeout_s,
                            max_version_lag=max_version_lag)  # fmt: skip
    clock = _Clock()
    logger = RecordingLogger()
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=4, logger=logger, callbacks=[clock, cb]))
    with (
        WeightReceiver(make_policy(), store=store, job="stall", name="stuck"),
        caplog.at_level(logging.WARNING, logger="lightning_wsync.callback"),
    ):
        started = time.monotonic()
        trainer.fit(PolicyModule(), train_dataloaders=loader())
        elapsed = time.monotonic() - started
    assert logger.values("wsync/version") == [0, 1, 2, 3, 4]
    assert set(logger.values("wsync/failed")) == {1.0}
    assert caplog.text.count("receiver 'stuck' did not get version") == 1  # then at DEBUG
    lags = logger.values("wsync/version_lag")
    assert lags == sorted(lags) and lags[-1] >= 2  # it falls further behind with every push
    assert elapsed < 2 * timeout_s + 10  # closing waits at most 2 * timeout_s for the last report
    if max_version_lag is None:
        assert logger.values("wsync/lag_wait_s") == []
        # Pushes 1..3 happen inside the loop; had any waited for the receiver it would take >= 3 * timeout_s.
        assert clock.loop_s < 2 * timeout_s, clock.loop_s
    else:
        waits = logger.values("wsync/lag_wait_s")
        assert len(waits) == 5 and all(0.5 * timeout_s <= w <= timeout_s + 1 for w in waits), waits
