"""The NIXL plane's pieces that need no NIXL: the pick, its records, its messages."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_wsync._control.records import NixlAgentRecord, RecordShape, SenderRecord
from lightning_wsync._planes import open as planes
from lightning_wsync._planes.nixl import messages
from lightning_wsync.errors import WeightSyncConfigError


def spec(transport: str, cross_host: str) -> planes.SenderSpec:
    return planes.SenderSpec(job="j", epoch=1, host="h", addr="127.0.0.1", transport=transport, cross_host=cross_host,
                             delta="off", device=torch.device("cpu"), timeout_s=5, heartbeat_timeout_s=5)  # fmt: skip


def wants_nixl(spec: planes.SenderSpec) -> bool:
    """The table's NIXL row: does this sender (on the CPU) offer it."""
    (row,) = [row for row in planes.PLANES if row.name == "nixl"]
    return row.offered(spec, False)


@pytest.mark.parametrize("why", [None, "NIXL is not installed (test)"])
def test_auto_picks_nixl_for_the_star_where_usable_and_says_which(monkeypatch, caplog, why):
    monkeypatch.setattr(planes.nixl_plane, "unusable", lambda: why)
    with caplog.at_level(logging.INFO, logger=planes.nixl_plane.__name__):  # the NIXL row says which
        assert wants_nixl(spec("auto", "star")) is (why is None)
    said = caplog.text
    assert ("READ through NIXL" in said) if why is None else ("gloo links (NIXL is not installed (test))" in said)
    if why is None:
        assert wants_nixl(spec("nixl", "relay")) is True
    else:
        with pytest.raises(WeightSyncConfigError, match=r"transport='nixl', but NIXL is not installed \(test\)"):
            wants_nixl(spec("nixl", "relay"))
    assert wants_nixl(spec("auto", "relay")) is False  # the relay's hops stay gloo
    assert wants_nixl(spec("gloo", "star")) is False


def test_agent_record_round_trips_and_refuses_bad_regions():
    record = NixlAgentRecord("wsync-s1-5-j", 5, "QUJD", ((4096, 4096), (8192, 100)))
    assert NixlAgentRecord.decode(record.encode()) == record
    for regions in ([[0, 10]], [[10, -1]], [[1, 2, 3]], "x"):
        with pytest.raises((RecordShape, ValueError, TypeError)):
            NixlAgentRecord.decode({**record.encode(), "regions": regions})  # type: ignore[dict-item]


def test_sender_record_says_nixl_only_when_offered():
    plain = SenderRecord(1, "h", 1, "a", 5.0, 5.0, "auto", "gloo", False, "seg")
    assert "nixl" not in plain.encode()  # type: ignore[operator]
    offered = SenderRecord(1, "h", 1, "a", 5.0, 5.0, "nixl", "gloo", False, "seg", nixl=True)
    assert SenderRecord.decode(offered.encode()) == offered and SenderRecord.decode(plain.encode()) == plain


def test_messages_round_trip_and_ignore_strangers():
    g = messages.Grant(3, 7, 1, 12, [12, -5, 9])
    kind, numbers = messages.parse(messages.grant(g)) or ("", [])
    assert kind == "G" and messages.as_grant(numbers) == g
    assert messages.parse(messages.pin(4, None)) == ("P", [4, -1])
    assert messages.parse(messages.touch(4)) == ("T", [4])
    for stranger in (b"", b"X 1", b"G", b"P x", b"\xff\xfe"):
        assert messages.parse(stranger) is None


def test_the_table_names_each_plane_once_and_a_receiver_tries_each():
    names = [row.name for row in planes.PLANES]
    assert names == ["net", "shm", "relay", "nixl"]  # the order a sender opens and closes them
    assert sorted(planes.RECEIVE_ORDER) == sorted(names) and planes.RECEIVE_ORDER[-1] == "net"  # net serves all
    cpu = spec("gloo", "star")
    assert [row.name for row in planes.PLANES if row.offered(cpu, False)] == ["net"]
    auto = spec("auto", "relay")
    assert [row.name for row in planes.PLANES if row.offered(auto, False)] == ["net", "shm", "relay"]
    assert [row.name for row in planes.PLANES if row.offered(auto, True)] == ["net"]  # from the GPU: links only


def test_hop_messages_round_trip_and_relay_rid_matches_the_relay():
    from lightning_wsync._planes.relay.hops import RELAY_RID

    assert messages.RELAY_RID == RELAY_RID  # a layer apart: the same number
    g = messages.HopGrant(5, 9, 1, 13, 40, 1, 1 << 20, [40, 7, -3])
    kind, numbers = messages.parse(messages.hop_grant(g)) or ("", [])
    assert kind == "H" and messages.as_hop_grant(numbers) == g
    assert messages.as_hop_grant([1, 2, 3, 4, 5, 6, 7]) is None  # no trailer
    assert messages.parse(messages.landed(5, 4096)) == ("L", [5, 4096])
    assert messages.parse(messages.kept(5)) == ("K", [5]) and messages.parse(messages.dropped(5)) == ("D", [5])


def test_hop_chunks_cover_every_bucket_without_straddling():
    from lightning_wsync._control.manifest import build_manifest
    from lightning_wsync._planes.nixl.hop import hop_chunks

    layout = build_manifest({"a": torch.zeros(300_000), "b": torch.zeros(70_000)}, None, bucket_bytes=1 << 20)
    got = hop_chunks(layout, 1 << 18)
    assert [(a, b) for a, b, _ in got][0][0] == 0 and got[-1][1] == layout.total_bytes
    assert all(got[i][1] == got[i + 1][0] for i in range(len(got) - 1))
    assert all(layout.buckets[k][0] <= a < b <= layout.buckets[k][1] for a, b, k in got)


def test_a_peer_not_published_yet_is_debug_until_it_lasts_timeout_s_and_a_failure_is_said_once():
    from lightning_wsync._planes.nixl.agent import Failures, NixlError, NotPublished

    forming = NotPublished("the upstream (leader3) published no NIXL agent")
    assert Failures(timeout_s=10).failed(forming) == logging.DEBUG  # a chain forming: not news
    assert Failures(timeout_s=0).failed(forming) == logging.WARNING  # past timeout_s: it is
    failures = Failures(timeout_s=10)
    garbled = NixlError("record 'nixl/1/agent/leader2' ... holds '\\x00garbage'")
    levels = [failures.failed(garbled) for _ in range(3)]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG] and failures.count == 3  # said once
    assert failures.failed(NixlError("a transfer in error")) == logging.WARNING  # something else: news
    failures.cleared()
    assert failures.failed(garbled) == logging.WARNING and failures.count == 1  # once more after a success
