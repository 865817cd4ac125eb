"""Shared secret: signed control records, refusal of peers without it, on both sides."""

from __future__ import annotations

import logging

import pytest
from _workers import digest, mixed_model, mutate

from lightning_wsync import WeightReceiver, WeightSender, WeightSyncAuthError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("transport", ["auto", "gloo"])
def test_same_secret_delivers(port, transport):
    store = f"127.0.0.1:{port}"
    src, dst = mixed_model(0), mixed_model(1)
    with WeightSender(src, store=store, job="a", secret="s3cret", transport=transport, timeout_s=10) as sender:
        with WeightReceiver(dst, store=store, job="a", secret="s3cret") as receiver:
            mutate(src, 1)
            handle = sender.push(1)
            assert receiver.wait_for_version(1, timeout_s=10) == 1
            assert handle.wait(10).delivered == (receiver.name,)
    assert digest(dst) == digest(src)


@pytest.mark.parametrize(("sender_secret", "receiver_secret", "match"), [
    ("right", "wrong", "signed with a different secret"),
    (None, "right", "is not signed, but this process requires the shared secret"),
    ("right", None, "is signed but this process has no secret"),
])
def test_wrong_or_missing_secret_is_refused_on_both_sides(port, caplog, sender_secret, receiver_secret, match):
    store = f"127.0.0.1:{port}"
    src, dst = mixed_model(0), mixed_model(1)
    before = digest(dst)
    with caplog.at_level(logging.ERROR, logger="lightning_wsync"):
        with WeightSender(src, store=store, job="b", secret=sender_secret, timeout_s=5) as sender:
            with WeightReceiver(dst, store=store, job="b", secret=receiver_secret, name="intruder") as receiver:
                report = sender.push(1).wait(2)
                with pytest.raises(WeightSyncAuthError, match=match):
                    receiver.wait_for_version(1, timeout_s=10)
                assert report.delivered == ()
                assert "intruder" not in sender.receivers()
    assert digest(dst) == before
    if sender_secret is not None and receiver_secret != sender_secret:
        assert any("refused receiver" in r.getMessage() for r in caplog.records if r.name.endswith("membership"))


def test_stranger_cannot_feed_weights(port):
    import json

    import torch.distributed as dist

    store = f"127.0.0.1:{port}"
    src, dst, evil = mixed_model(0), mixed_model(1), mixed_model(2)
    with WeightSender(src, store=store, job="c", secret="k", timeout_s=5) as sender:
        sender.push(1)
        with pytest.raises(WeightSyncAuthError, match="record 'latest' of job 'c' is signed with a different secret"):
            WeightSender(evil, store=store, job="c", secret="guess")
        with WeightReceiver(dst, store=store, job="c", secret="k") as receiver:
            assert receiver.wait_for_version(1, timeout_s=10) == 1
            # A stranger with raw store access forges a sender epoch and a newer version.
            raw = dist.PrefixStore("wsync/c", dist.TCPStore("127.0.0.1", port, is_master=False))
            raw.set("sender/99", json.dumps({"epoch": 99, "host": "x", "pid": 1, "transport": "gloo",
                                             "backend": "gloo", "shm": None, "addr": "127.0.0.1"}))
            raw.set("layout/99", json.dumps(sender.layout.to_json()))
            raw.set("sender/current", "99")
            raw.set("latest", json.dumps({"version": 50, "epoch": 99, "gen": 2}))
            assert receiver.update() is None
            mutate(src, 2)
            sender.push(51)
            assert receiver.wait_for_version(51, timeout_s=10) == 51
    assert digest(dst) == digest(src)
