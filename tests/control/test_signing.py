"""Signing in one process, on a real in-memory store: control records, channel items, link trailers."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from lightning_wsync import WeightSyncAuthError
from lightning_wsync._control import keys
from lightning_wsync._control.store import Control
from lightning_wsync._planes.wire import trailer_mac
from lightning_wsync.channel import ExperienceReader, ExperienceWriter


def _control(store: dist.Store, secret: bytes | None, job: str = "j") -> Control:
    return Control(store, job, secret)


def test_records_round_trip_with_and_without_a_secret():
    store = dist.HashStore()
    for secret in (None, b"k"):
        ctl = _control(store, secret)
        ctl.set_json(keys.LATEST, {"version": 3, "epoch": 1})
        assert ctl.get_json(keys.LATEST) == {"version": 3, "epoch": 1}
    plain = json.loads(_control(store, None).seal(keys.LATEST, {"a": 1}))
    signed = json.loads(_control(store, b"k").seal(keys.LATEST, {"a": 1}))
    assert plain == {"a": 1} and set(signed) == {"wsync_signed", "mac"}


@pytest.mark.parametrize(
    ("writer", "reader", "match"),
    [
        (b"right", b"wrong", r"record 'latest' of job 'j' is signed with a different secret"),
        (None, b"right", r"record 'latest' of job 'j' is not signed, but this process requires the shared secret"),
        (b"right", None, r"record 'latest' of job 'j' is signed but this process has no secret"),
    ],
)
def test_a_record_from_a_peer_without_the_secret_is_refused(writer, reader, match):
    store = dist.HashStore()
    _control(store, writer).set_json(keys.LATEST, {"version": 1, "epoch": 1})
    with pytest.raises(WeightSyncAuthError, match=match):
        _control(store, reader).get_json(keys.LATEST)


def test_a_signed_record_is_bound_to_its_key_and_its_job():
    ctl = _control(dist.HashStore(), b"k")
    sealed = ctl.seal(keys.version_record(5), {"version": 5, "epoch": 1})
    assert ctl.open(keys.version_record(5), sealed) == {"version": 5, "epoch": 1}
    with pytest.raises(WeightSyncAuthError, match=r"record 'v/6' of job 'j' is signed with a different secret"):
        ctl.open(keys.version_record(6), sealed)  # replayed under another version's key
    other_job = _control(dist.HashStore(), b"k", job="other")
    with pytest.raises(WeightSyncAuthError, match=r"of job 'other' is signed with a different secret"):
        other_job.open(keys.version_record(5), sealed)


def test_byte_macs_are_zero_without_a_secret_and_bound_to_the_job():
    store = dist.HashStore()
    assert _control(store, None).mac_bytes(b"m") == bytes(32)
    a, b = _control(store, b"k", job="a").mac_bytes(b"m"), _control(store, b"k", job="b").mac_bytes(b"m")
    assert len(a) == 32 and a != bytes(32) and a != b
    assert _control(store, b"k2", job="a").mac_bytes(b"m") != a


def test_trailer_mac_covers_every_field():
    ctl = _control(dist.HashStore(), b"k")
    base = trailer_mac(ctl, 1, 2, 3, 4, [5, -6])
    assert len(base) == 4 and base == trailer_mac(ctl, 1, 2, 3, 4, [5, -6])
    changed = [
        trailer_mac(ctl, 9, 2, 3, 4, [5, -6]),  # epoch
        trailer_mac(ctl, 1, 9, 3, 4, [5, -6]),  # receiver
        trailer_mac(ctl, 1, 2, 9, 4, [5, -6]),  # version
        trailer_mac(ctl, 1, 2, 3, 9, [5, -6]),  # slot sequence
        trailer_mac(ctl, 1, 2, 3, 4, [5, -7]),  # checksums
    ]
    assert all(mac != base for mac in changed)
    assert trailer_mac(_control(dist.HashStore(), None), 1, 2, 3, 4, [5]) == [0, 0, 0, 0]


def _read_one(store: dist.Store, secret: str | None) -> dict:
    reader = ExperienceReader(store=store, job="c", secret=secret, max_items=1, idle_timeout_s=5)
    return next(iter(reader))


def test_channel_items_are_signed_and_checked():
    store = dist.HashStore()
    ExperienceWriter(store=store, job="c", secret="k").put({"x": torch.ones(2)}, 3)
    item = _read_one(store, "k")
    assert torch.equal(item["x"], torch.ones(2)) and int(item["version"]) == 3
    ExperienceWriter(store=store, job="c", secret="guess").put({"x": torch.ones(2)}, 4)
    with pytest.raises(WeightSyncAuthError, match=r"is signed with a different secret; it was dropped"):
        _read_one(store, "k")
    ExperienceWriter(store=store, job="c").put({"x": torch.ones(2)}, 5)
    with pytest.raises(WeightSyncAuthError, match=r"is not signed; it was dropped"):
        _read_one(store, "k")
    ExperienceWriter(store=store, job="c", secret="k").put({"x": torch.ones(2)}, 6)
    with pytest.raises(WeightSyncAuthError, match=r"is signed but this reader has no secret"):
        _read_one(store, None)
