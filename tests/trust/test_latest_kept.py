"""The sender keeps ``latest`` its own (issue 32: store keys as hostile input).

TCPStore orders requests per connection only: a store writer's value sent before a push can land
after the sender's record of it. CI, 2026-11-29: the store fuzz's 1 MB value in ``latest`` landed
after version 42's record, and the network receiver (a NIXL reader, which learns versions from
``latest``) waited 20 s for a version already published. Now the sender reads ``latest`` back every
``backstop_s`` and writes its own again: a receiver joining after the damage gets the version."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from _workers import digest, mixed_model, mutate

from lightning_wsync import WeightReceiver, WeightSender
from lightning_wsync._control import keys
from lightning_wsync._control.records import VersionRecord
from lightning_wsync._control.store import Control

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

JOB, SECRET = "latest-kept", "latest-secret"


def test_a_latest_record_replaced_after_a_push_is_written_again(port, monkeypatch, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="lightning_wsync")
    store = f"127.0.0.1:{port}"
    src, dst = mixed_model(0), mixed_model(1)
    with WeightSender(src, store=store, job=JOB, secret=SECRET, cross_host="star", timeout_s=10) as sender:
        ctl = Control(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)), JOB,
                      SECRET.encode())  # fmt: skip
        mine = VersionRecord(2, sender.epoch)
        for version in (1, 2):
            mutate(src, version)
            sender.push(version)
        deadline = time.monotonic() + 10
        while ctl.get_record(keys.LATEST, VersionRecord) != mine:  # the sender's record is stored
            assert time.monotonic() < deadline, "version 2 was never published"
            time.sleep(0.01)
        ctl.store.set(keys.LATEST, b'"' + b"A" * 100_000 + b'"')
        assert bytes(ctl.store.get(keys.LATEST)).startswith(b'"AAA')  # stored: this connection's next request
        monkeypatch.setenv("WSYNC_HOST_ID", "latest-other-host")  # read at construction: the network path
        receiver = WeightReceiver(dst, store=store, job=JOB, secret=SECRET, name="late")
        monkeypatch.delenv("WSYNC_HOST_ID")
        with receiver:
            assert receiver.wait_for_version(2, timeout_s=30) == 2
            assert receiver.latest_published == 2
        assert digest(dst) == digest(src)
        assert ctl.get_record(keys.LATEST, VersionRecord) == mine
    said = [r.getMessage() for r in caplog.records if "written again" in r.getMessage()]
    assert said == [f"sender: 'latest' of job {JOB!r} held an unreadable record, not version 2 it published; "
                    "written again (said once)"], said  # fmt: skip
