"""Typed records through Control, the one decode boundary: whatever the store holds, a
read raises WeightSyncRecordError or WeightSyncAuthError naming the key, never a raw
JSON, type or key error; counters stay usable; signatures bind the run (issue 21 items 2, 8)."""

from __future__ import annotations

import hashlib
import json
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_wsync import WeightSyncAuthError, WeightSyncRecordError
from lightning_wsync._control import fleet_records, keys, records
from lightning_wsync._control.signing import KDF_ITERATIONS, derive_key, resolve_secret
from lightning_wsync._control.store import Control

pytestmark = pytest.mark.timeout(60)


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


def _signed(body: object, mac: object) -> str:
    return json.dumps({"wsync_signed": body, "mac": mac})


GARBAGE = [
    ("not JSON", None, b"{nope", WeightSyncRecordError, "which is not JSON"),
    ("not UTF-8", None, b"\xff\xfe\x00", WeightSyncRecordError, "which is not JSON"),
    ("wrong type", None, b'{"epoch": "7"}', WeightSyncRecordError, r"epoch='7' is not an integer; expected"),
    ("a list", None, b"[1, 2]", WeightSyncRecordError, "not an object but list"),
    ("missing field", None, b"{}", WeightSyncRecordError, "missing epoch"),
    ("huge", None, b'"' + b"x" * 2_000_000 + b'"', WeightSyncRecordError, r"\(\+\d+ chars\)"),
    ("deep", None, b"[" * 100_000, WeightSyncRecordError, "which is not JSON"),
    ("non-ASCII mac", b"k", _signed('{"epoch": 1}', "é").encode(), WeightSyncAuthError, "different secret"),
    ("mac not a string", b"k", _signed('{"epoch": 1}', 5).encode(), WeightSyncAuthError, "different secret"),
    ("body not a string", b"k", _signed(5, "00").encode(), WeightSyncAuthError, "different secret"),
    ("unsigned", b"k", b'{"epoch": 1}', WeightSyncAuthError, "is not signed"),
]


@pytest.mark.parametrize(("what", "secret", "raw", "error", "match"), GARBAGE, ids=[g[0] for g in GARBAGE])
def test_a_bad_record_raises_a_weight_sync_error_naming_the_key(server, what, secret, raw, error, match):
    ctl = Control(_client(server), "j", secret)
    ctl.store.set(keys.SENDER_CURRENT, raw)
    with pytest.raises(error, match=match) as caught:
        ctl.get_record(keys.SENDER_CURRENT, records.SenderPointer)
    assert "'sender/current'" in str(caught.value) and "of job 'j'" in str(caught.value)
    assert len(str(caught.value)) < 600  # a short !r of the value, not all of it
    assert ctl.has(keys.SENDER_CURRENT)  # the connection is fine


def test_every_record_round_trips_and_old_member_states_still_read(server):
    ctl = Control(_client(server), "j", b"k")
    examples = [
        records.SenderPointer(3),
        records.SenderRecord(3, "h", 11, "10.0.0.1", 10.0, 30.0, "auto", "gloo", False, None),
        records.VersionRecord(5, 3),
        records.SumsRecord(5, (1, -2)),
        records.MemberRecord("r0", "h", 12, 4026531836, True),
        records.MemberState(4, records.Rejection(5, "checksum mismatch")),
        records.MembersLow(7),
        records.ClosedRecord(False),
        records.LeaderRecord(2, 13, 1, "wsync-j-relay-3"),
        records.ChainRecord(4, (2, 9)),
        records.ReceiptsRecord({5: records.Receipt(True, 100, 0.25, 0.01)}),
        fleet_records.FleetAck("g", 3, 7, True),
        fleet_records.FleetRound(2, 7, (1, 4), (5, -6)),
        fleet_records.FleetSwitches((fleet_records.FleetSwitch(2, 7, (1,), {"r4": "did not stage"}, 12.5),)),
    ]
    for i, record in enumerate(examples):
        key = f"example/{i}"
        ctl.put(key, record)
        assert ctl.get_record(key, type(record)) == record
    ctl.set_json("old", {"acked": 4, "error": [5, "bad"]})  # receivers before the typed state
    assert ctl.get_record("old", records.MemberState) == records.MemberState(4, records.Rejection(5, "bad"))
    ctl.set_json("older", True)  # senders that wrote a bare true into closed/<epoch>
    assert ctl.get_record("older", records.ClosedRecord) == records.ClosedRecord(True)
    assert ctl.get_record("absent", records.VersionRecord) is None


@pytest.mark.parametrize("garbage", ["abc", "", "99999999999999999999999", "é", "1.5"])
def test_a_non_integer_counter_is_refused_and_the_connection_survives(server, garbage):
    ctl = Control(_client(server), "j")
    ctl.set_text(keys.MEMBERS_NEXT, garbage)
    for amount in (0, 1):
        with pytest.raises(WeightSyncRecordError, match=r"counter 'members/next' of job 'j' holds .*not an integer"):
            ctl.add(keys.MEMBERS_NEXT, amount)
    # TCPStore drops a client whose add() meets a non-integer: this one was never exposed to that.
    assert ctl.has(keys.MEMBERS_NEXT)
    ctl.set_text(keys.MEMBERS_NEXT, "41")
    assert ctl.add(keys.MEMBERS_NEXT, 1) == 42 and ctl.add(keys.MEMBERS_NEXT, 0) == 42
    assert ctl.add("fresh", 0) == 0 and not ctl.has("fresh")  # reading an absent counter creates nothing
    assert ctl.add("fresh", 2) == 2


def test_a_record_signed_in_another_run_is_refused(port):
    """Same job and secret, a fresh store (a relaunch): a replayed closed/1 must not end anyone."""
    first = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    second = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    old, new = Control(first, "j", b"k"), Control(second, "j", b"k")
    old.put(keys.closed(1), records.ClosedRecord(True))
    recorded = old.get_raw(keys.closed(1))
    assert old.run_id() != new.run_id()
    new.store.set(keys.closed(1), recorded)
    refused = r"record 'closed/1' of job 'j' is signed with a different secret or in another run"
    with pytest.raises(WeightSyncAuthError, match=refused):
        new.get_record(keys.closed(1), records.ClosedRecord)
    assert Control(_client_of(second), "j", b"k").run_id() == new.run_id()  # every peer of a run agrees
    assert new.clone().run_id() == new.run_id()


def _client_of(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


def test_the_hmac_key_is_derived_not_the_secret(monkeypatch):
    started = time.perf_counter()
    key = derive_key(b"weak-secret", "job-derive-test")
    cost_s = time.perf_counter() - started
    assert key == hashlib.pbkdf2_hmac("sha256", b"weak-secret", b"lightning_wsync/v1/job-derive-test", KDF_ITERATIONS)
    assert key != b"weak-secret" and derive_key(b"weak-secret", "other-job") != key
    assert cost_s > 0.01  # a guess costs real work (0.07-0.09 s on one core when measured)
    assert Control(dist.HashStore(), "job-derive-test", b"weak-secret").secret == key
    monkeypatch.setenv("WSYNC_SECRET", "")
    with pytest.raises(ValueError, match=r"WeightSender: WSYNC_SECRET is set but empty"):
        resolve_secret(None, "WeightSender")
    with pytest.raises(ValueError, match=r"secret= is set but empty"):
        resolve_secret("", "WeightSender")
