"""Every public parameter and --rdzv-conf key with invalid values: a clear error naming
it, and nothing left behind (no thread, no shared-memory segment, no half-open sender)."""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any

import pytest
from _sharded import sharded_model, zeroed_sharded_model
from _workers import mixed_model

from lightning_wsync import (
    ExperienceReader,
    ExperienceWriter,
    ReceiverConfig,
    SenderConfig,
    WeightReceiver,
    WeightSender,
    WeightSyncCallback,
    WeightSyncConfigError,
)
from lightning_wsync._planes.shares import ShareWriter
from lightning_wsync._push.shares import prepare_shares
from lightning_wsync.rendezvous import parse_rdzv_conf

S = "127.0.0.1:1"  # never contacted: validation comes first

CASES: list[tuple[str, Any, dict[str, Any], type[Exception], str]] = [
    # (what, factory, kwargs, error, message pattern)
    ("sender dtype", WeightSender, {"dtype": "int8"}, ValueError, r"dtype='int8' is not supported; choose one of"),
    ("sender include", WeightSender, {"include": "*.weight"}, TypeError, r"include='\*.weight' must be a list"),
    ("sender exclude", WeightSender, {"exclude": [3]}, TypeError, r"exclude=\[3\] must be a list of glob patterns"),
    ("sender bucket_mb", WeightSender, {"bucket_mb": 0}, ValueError, r"bucket_mb=0 must be a number > 0"),
    ("sender timeout_s", WeightSender, {"timeout_s": "30"}, ValueError, r"timeout_s='30' must be a number > 0"),
    ("sender transport", WeightSender, {"transport": "udp"}, ValueError, r"transport='udp' is unknown; choose one of"),
    ("sender heartbeat", WeightSender, {"heartbeat_timeout_s": -1}, ValueError, r"heartbeat_timeout_s=-1 must be"),
    ("sender nccl on cpu", WeightSender, {"transport": "nccl"}, ValueError, r"transport='nccl' needs the module on a CUDA"),  # noqa: E501  (a table: one case per line)
    ("sender cuda_ipc on cpu", WeightSender, {"cuda_ipc": True}, ValueError,
     r"cuda_ipc=True shares snapshot slots on the module's GPU, but its tensors are on \['cpu'\]"),
    ("sender cuda_ipc over gloo", WeightSender, {"cuda_ipc": True, "transport": "gloo"}, ValueError,
     r"cuda_ipc=True serves same-host receivers .* transport='gloo'; use transport='auto', 'shm' or 'nixl'"),
    ("sender unknown option", WeightSender, {"bucket_size": 3}, TypeError, r"unexpected keyword argument 'bucket_size'"),  # noqa: E501  (a table: one case per line)
    ("sender store", WeightSender, {"store": "localhost"}, ValueError, r"store='localhost' is not 'host:port'"),
    ("sender store port", WeightSender, {"store": "h:99999"}, ValueError, r"store='h:99999' is not 'host:port'"),
    ("sender store type", WeightSender, {"store": 29400}, TypeError, r"store=29400 must be a torch.distributed.Store"),
    ("sender job", WeightSender, {"job": "a/b"}, ValueError, r"job='a/b' must not contain '/'"),
    ("sender config and default", WeightSender, {"config": SenderConfig(), "delta": "auto"}, TypeError, r"got config=SenderConfig\(...\) and the options \['delta'\]; pass one or the other"),  # noqa: E501  (a table: one case per line)
    ("receiver config and option", WeightReceiver, {"config": ReceiverConfig(), "verify": False}, TypeError, r"got config=ReceiverConfig\(...\) and the options \['verify'\]"),  # noqa: E501  (a table: one case per line)
    ("receiver name", WeightReceiver, {"name": ""}, ValueError, r"name='' must be non-empty"),
    ("receiver heartbeat", WeightReceiver, {"heartbeat_s": 0}, ValueError, r"heartbeat_s=0 must be a number > 0"),
    ("receiver timeout", WeightReceiver, {"timeout_s": None}, ValueError, r"timeout_s=None must be a number > 0"),
    ("receiver include", WeightReceiver, {"include": "x"}, TypeError, r"include='x' must be a list"),
    ("receiver verify", WeightReceiver, {"verify": "yes"}, TypeError, r"verify='yes' must be True or False"),
    ("receiver apply", WeightReceiver, {"apply": "move"}, ValueError, r"apply='move' must be one of \('copy', 'swap'\) \(default 'copy'\)"),  # noqa: E501  (a table: one case per line)
    ("receiver job", WeightReceiver, {"job": ""}, ValueError, r"job=''; pass job='<run name>' or set WSYNC_JOB"),
    ("callback every_n_steps", WeightSyncCallback, {"every_n_steps": 0}, ValueError, r"every_n_steps=0 must be an int >= 1"),  # noqa: E501  (a table: one case per line)
    ("callback module", WeightSyncCallback, {"every_n_steps": 1, "module": "a..b"}, ValueError, r"module='a..b' must be an attribute path"),  # noqa: E501  (a table: one case per line)
    ("callback lag", WeightSyncCallback, {"every_n_steps": 1, "max_version_lag": -1}, ValueError, r"max_version_lag=-1 must be an int >= 0"),  # noqa: E501  (a table: one case per line)
    ("callback dtype", WeightSyncCallback, {"every_n_steps": 1, "dtype": "fp8"}, ValueError, r"dtype='fp8' is not supported"),  # noqa: E501  (a table: one case per line)
    ("writer capacity", ExperienceWriter, {"capacity": 0}, ValueError, r"capacity=0 must be an int >= 1"),
    ("writer channel", ExperienceWriter, {"channel": "a/b"}, ValueError, r"channel='a/b' must be a non-empty name"),
    ("writer timeout", ExperienceWriter, {"timeout_s": 0}, ValueError, r"timeout_s=0 must be > 0"),
    ("reader idle timeout", ExperienceReader, {"idle_timeout_s": -5}, ValueError, r"idle_timeout_s=-5 must be > 0"),
    ("writer max item", ExperienceWriter, {"max_item_mb": 0}, ValueError, r"max_item_mb=0 must be a number > 0"),
    ("reader max item", ExperienceReader, {"max_item_mb": "1"}, ValueError, r"max_item_mb='1' must be a number > 0"),
]


def _build(factory: Any, kwargs: dict[str, Any]) -> Any:
    kwargs = dict(kwargs)
    if factory in (WeightSender, WeightReceiver):
        store = kwargs.pop("store", S)
        return factory(mixed_model(0), store=store, **{"job": "bad", **kwargs})
    if factory in (ExperienceWriter, ExperienceReader):
        return factory(store=S, job="bad", **kwargs)
    return factory(**kwargs)


@pytest.mark.parametrize(("what", "factory", "kwargs", "error", "match"), CASES, ids=[c[0] for c in CASES])
def test_bad_parameter(what, factory, kwargs, error, match):
    ours = f"/dev/shm/wsync-{os.getpid()}-*"  # this process's only: tests run side by side (pytest -n)
    segments = set(glob.glob(ours))
    with pytest.raises(error, match=match):
        _build(factory, kwargs)
    assert set(glob.glob(ours)) <= segments  # nothing created and left behind


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        ({}, r"--rdzv-conf has no 'role' key"),
        ({"role": "learner"}, r"key 'role' has invalid value 'learner'; valid roles: trainer, rollout"),
        ({"role": "trainer", "colour": "blue"}, r"unknown --rdzv-conf key 'colour' \(value 'blue'\); valid keys:"),
        ({"role": "rollout", "last_call_timeout": "soon"}, r"key 'last_call_timeout' has invalid value 'soon'"),
        ({"role": "rollout", "join_timeout": "-3"}, r"key 'join_timeout' has invalid value '-3'"),
        ({"role": "rollout", "is_host": "maybe"}, r"key 'is_host' has invalid value 'maybe'; expected true or false"),
    ],
)
def test_bad_rdzv_conf(conf, match):
    with pytest.raises(ValueError, match=match):
        parse_rdzv_conf(conf)


def test_bad_push_versions_leave_the_published_version_intact(port):
    with WeightSender(mixed_model(0), store=f"127.0.0.1:{port}", job="v") as sender:
        sender.push(5)
        for bad, match in [(-1, r"version=-1 must be an int >= 0"), (2.5, r"version=2.5 must be an int"),
                           (True, r"version=True must be an int"), (5, r"version=5 is not above")]:  # fmt: skip
            with pytest.raises(ValueError, match=match):
                sender.push(bad)
        assert sender.latest_version == 5
        with WeightReceiver(mixed_model(1), store=f"127.0.0.1:{port}", job="v") as receiver:
            assert receiver.wait_for_version(5, timeout_s=10) == 5


@pytest.mark.timeout(60)
def test_a_sharded_sender_with_no_relay_refuses_a_receiver_on_another_host(port, monkeypatch):
    """cross_host='star' (or transport='shm'): the ranks' shares reach their own host only."""
    address, model = f"127.0.0.1:{port}", sharded_model()
    cfg = SenderConfig(job="xs", cross_host="star", timeout_s=5)
    monkeypatch.setenv("WSYNC_HOST_ID", "trainer-a")
    mine, theirs = prepare_shares(model, cfg, 0, 2), prepare_shares(model, cfg, 1, 2)
    writer = ShareWriter(theirs, cfg)
    try:
        plan = mine.plan.with_segments(["", writer.name], ["trainer-a", "trainer-a"])
        with WeightSender(model, store=address, config=cfg, shares=dataclasses.replace(mine, plan=plan)) as sender:
            assert writer.write(1)
            sender.push(1)
            monkeypatch.setenv("WSYNC_HOST_ID", "rollout-1")
            with WeightReceiver(zeroed_sharded_model(), store=address, job="xs", timeout_s=5) as receiver:
                with pytest.raises(WeightSyncConfigError, match=(
                    r"the trainer pushes sharded with no relay \(transport='auto', cross_host='star' or "
                    r"transport='shm'\), which reaches receivers on the trainer ranks' hosts only: ranks run on "
                    r"\['trainer-a'\], not here \('rollout-1'\); use "
                    r"transport='auto' with cross_host='relay' or 'chain' on the trainer")):  # fmt: skip
                    receiver.wait_for_version(1, timeout_s=10)
    finally:
        writer.close()
