"""A hostile or buggy writer of the store (issue 21 items 2, 8, 11): one bad record is
reported once and ignored; the sender keeps publishing and receivers keep applying;
a record from another run is refused; the secret never reaches a log line."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from _spawn import CTX
from _workers import Inbox, build, collect, digest, mixed_model, mutate, receiver_main

from lightning_wsync import (
    CallbackConfig,
    ReceiverConfig,
    SenderConfig,
    WeightReceiver,
    WeightSender,
    WeightSyncCallback,
)
from lightning_wsync._control import keys, records
from lightning_wsync._control.store import Control

pytestmark = pytest.mark.timeout(180)


def _raw(port: int, job: str) -> dist.Store:
    """The store as anyone who can reach it sees it: no secret, no checks."""
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    return dist.PrefixStore(keys.job_prefix(job), client)


def _errors_naming(caplog: pytest.LogCaptureFixture, key: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and repr(key) in r.getMessage()]


def test_bad_records_and_counters_never_stop_the_sender_or_the_receiver(port, caplog):
    """Old code: the non-JSON member record killed the sender's background thread (nothing
    published again), the garbled heartbeat counter made TCPStore drop both clients, and the
    bad sender/current logged a traceback every 50 ms naming no key."""
    store = f"127.0.0.1:{port}"
    src, dst = mixed_model(0), mixed_model(1)
    with caplog.at_level(logging.ERROR, logger="lightning_wsync"):
        with WeightSender(src, store=store, job="f", secret="k", transport="gloo", timeout_s=10) as sender:
            with WeightReceiver(dst, store=store, job="f", secret="k", name="good") as receiver:
                mutate(src, 1)
                sender.push(1)
                assert receiver.wait_for_version(1, timeout_s=10) == 1
                raw = _raw(port, "f")
                stranger = int(raw.add(keys.MEMBERS_NEXT, 1)) - 1
                raw.set(keys.member(stranger), "{not json")
                raw.set(keys.SENDER_CURRENT, '{"wsync_signed": "{}", "mac": "\u00e9"}')
                raw.set(keys.member_heartbeat(receiver.rid), "abc")
                raw.set(keys.member_state(receiver.rid), '{"acked": "lots"}')
                for version in (2, 3, 4):
                    mutate(src, version)
                    handle = sender.push(version)
                    assert receiver.wait_for_version(version, timeout_s=15) == version
                    assert handle.wait(15).delivered == ("good",)
                assert digest(dst) == digest(src)
                assert sender.receivers() == ["good"]
                deadline = time.monotonic() + 10  # sender/current is read every 50 ms, heartbeats every refresh
                while not (_errors_naming(caplog, keys.SENDER_CURRENT)
                           and _errors_naming(caplog, keys.member_heartbeat(receiver.rid))):  # fmt: skip
                    assert time.monotonic() < deadline, "a bad record was never reported"
                    time.sleep(0.01)
                mutate(src, 5)
                sender.push(5)
                assert receiver.wait_for_version(5, timeout_s=15) == 5  # and reported once only
    assert len(_errors_naming(caplog, keys.member(stranger))) == 1
    assert len(_errors_naming(caplog, keys.SENDER_CURRENT)) == 1
    assert 1 <= len(_errors_naming(caplog, keys.member_heartbeat(receiver.rid))) <= 2  # sender and/or receiver
    assert not [r for r in caplog.records if r.exc_info], "a bad record must not end in a traceback"


def test_a_close_record_replayed_from_another_run_ends_nobody(port, caplog):
    """Old code: the MAC bound job, key and body only, so the same job relaunched on a fresh
    store accepted run 1's closed/1 and every receiver saw sender_closed."""
    # Record run 1's close on a store that outlives it, then replay it into run 2.
    keeper = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    with WeightSender(mixed_model(0), store=f"127.0.0.1:{keeper.port}", job="r", secret="k"):
        pass  # close(final=True) writes closed/1
    replay = _raw(keeper.port, "r").get(keys.closed(1))
    src, dst = mixed_model(0), mixed_model(1)
    with WeightSender(src, store=f"127.0.0.1:{port}", job="r", secret="k", timeout_s=10) as sender:
        with WeightReceiver(dst, store=f"127.0.0.1:{port}", job="r", secret="k") as receiver:
            mutate(src, 1)
            sender.push(1)
            assert receiver.wait_for_version(1, timeout_s=10) == 1
            assert sender.epoch == 1
            with caplog.at_level(logging.ERROR, logger="lightning_wsync"):
                _raw(port, "r").set(keys.closed(1), replay)
                deadline = time.monotonic() + 10  # the watcher reads closed/<epoch> every 50 ms
                while not _errors_naming(caplog, keys.closed(1)):
                    assert time.monotonic() < deadline, "the replayed close record was never refused"
                    time.sleep(0.01)
            assert "signed with a different secret or in another run" in _errors_naming(caplog, keys.closed(1))[0]
            mutate(src, 2)
            sender.push(2)
            assert receiver.wait_for_version(2, timeout_s=10) == 2
            assert not receiver.sender_closed and not receiver.sender_left
    assert digest(dst) == digest(src)


def test_the_secret_is_never_in_a_repr_or_an_error():
    """Old code: repr() showed secret='...', and so did the TypeError for a config plus options."""
    configs = [SenderConfig(secret="hunter2-s"), ReceiverConfig(secret="hunter2-r"),
               CallbackConfig(secret="hunter2-c", every_n_steps=1)]  # fmt: skip
    for config in configs:
        assert "hunter2" not in repr(config) and "hunter2" not in str(config)
    for owner, config in ((WeightSender, configs[0]), (WeightReceiver, configs[1])):
        with pytest.raises(TypeError, match="pass one or the other") as caught:
            owner(mixed_model(0), config=config, timeout_s=3)
        assert "hunter2" not in str(caught.value)
        with pytest.raises(TypeError, match=r"config=<dict with keys \['secret'\]> must be a") as caught:
            owner(mixed_model(0), config={"secret": "hunter2-d"})
        assert "hunter2" not in str(caught.value)
    with pytest.raises(TypeError) as caught:
        WeightSyncCallback(1, sender=configs[0], timeout_s=3)
    assert "hunter2" not in str(caught.value)


def test_an_empty_secret_is_a_configuration_error(port, monkeypatch):
    """Old code: WSYNC_SECRET='' turned signing off without a word."""
    with pytest.raises(ValueError, match=r"secret must be a non-empty string"):
        SenderConfig(secret="")
    monkeypatch.setenv("WSYNC_SECRET", "")
    with pytest.raises(ValueError, match=r"WeightSender: WSYNC_SECRET is set but empty"):
        WeightSender(mixed_model(0), store=f"127.0.0.1:{port}", job="e")
    with pytest.raises(ValueError, match=r"WeightReceiver: WSYNC_SECRET is set but empty"):
        WeightReceiver(mixed_model(0), store=f"127.0.0.1:{port}", job="e")


@pytest.mark.slow
def test_a_forged_relay_leader_record_is_replaced(port, monkeypatch, children):
    """Old code: a leader record that did not verify raised in every host-mate's election,
    forever, so nobody replaced it and the host got no further versions."""
    store, spec = f"127.0.0.1:{port}", ("mixed", 0)
    src = build(spec)
    inbox = Inbox(CTX)
    with WeightSender(src, store=store, job="l", secret="k", timeout_s=10) as sender:  # cross_host="relay"
        monkeypatch.setenv("WSYNC_HOST_ID", "relay-host-b")  # inherited by the spawned host-mates
        for name in ("b0", "b1"):
            args = (store, "l", name, spec, inbox.queue(name), {"secret": "k"})
            child = CTX.Process(target=receiver_main, args=args, daemon=True)
            child.start()
            children.track(child.pid)
        monkeypatch.delenv("WSYNC_HOST_ID")
        collect(inbox, "ready", {"b0", "b1"}, timeout_s=120)
        leader_key = keys.relay_leader(sender.epoch, "relay-host-b")
        raw = _raw(port, "l")
        for version in (1, 2, 3):
            if version == 2:
                assert raw.check([leader_key])
                raw.set(leader_key, '{"wsync_signed": "{\\"rid\\": 99}", "mac": "forged"}')
                deadline = time.monotonic() + 30
                while b"forged" in bytes(raw.get(leader_key)):  # a host-mate takes over by compare-and-set
                    assert time.monotonic() < deadline, "the forged leader record was never replaced"
                    time.sleep(0.02)
            mutate(src, version)
            sender.push(version)
            got = collect(inbox, "version", {"b0", "b1"}, timeout_s=60)
            assert {msg[2] for msg in got.values()} == {version}
            assert {msg[3] for msg in got.values()} == {digest(src)}


def test_a_sender_epoch_refused_once_is_followed_when_its_record_changes(server, port, caplog):
    """Old code: an epoch whose record failed verification once was skipped for good, so
    the real sender that then wrote that epoch's record was never followed."""
    store = f"127.0.0.1:{port}"
    src, dst = mixed_model(0), mixed_model(1)
    with WeightReceiver(dst, store=store, job="p", secret="k", timeout_s=10) as receiver:
        with WeightSender(src, store=store, job="p", secret="k", timeout_s=10) as first:
            mutate(src, 1)
            first.push(1)
            assert receiver.wait_for_version(1, timeout_s=15) == 1
            raw = _raw(port, "p")
            raw.set(keys.sender_record(2), '{"epoch": 2, "host": "x"}')  # unsigned: refused
            signer = Control(dist.TCPStore("127.0.0.1", port, is_master=False), "p", b"k")
            signer.put(keys.SENDER_CURRENT, records.SenderPointer(2))  # announced, as a sender does first
            with caplog.at_level(logging.ERROR, logger="lightning_wsync"):
                deadline = time.monotonic() + 10
                while not _errors_naming(caplog, keys.sender_record(2)):
                    assert time.monotonic() < deadline, "the forged sender record was never refused"
                    time.sleep(0.01)
            first.close(final=False)
        with WeightSender(src, store=store, job="p", secret="k", timeout_s=10) as second:
            assert second.epoch == 2  # it overwrites the refused record with its own
            mutate(src, 2)
            second.push(2)
            assert receiver.wait_for_version(2, timeout_s=15) == 2
    assert digest(dst) == digest(src)
