"""A sharded push relayed across hosts, in one process: trainer ranks 0 and 1 on two host ids,
each relaying its own share; receivers on two rollout host ids (one with two host-mates) and
on rank 1's host. Real TCPStore, real gloo hops on loopback; hosts are told apart by
``WSYNC_HOST_ID``. All shares of a version or none of it, on every host."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch
from _sharded import sharded_model, zeroed_sharded_model
from torch import nn

from lightning_wsync import SenderConfig, WeightReceiver, WeightSender
from lightning_wsync._control import keys
from lightning_wsync._control.records import ChainRecord
from lightning_wsync._planes.shares import ShareWriter
from lightning_wsync._push.shares import prepare_shares
from lightning_wsync.testing.models import digest, mutate

pytestmark = pytest.mark.timeout(120)

_WAIT_S = 30.0


_model, _zeroed = sharded_model, zeroed_sharded_model


def _stream_holds(receiver: WeightReceiver, rank: int, version: int) -> bool:
    """Rank ``rank``'s ring as ``receiver`` reads it holds ``version`` complete (test-only look inside)."""
    source = receiver._watcher.source
    rings = getattr(source, "_rings", None)
    if not rings:
        return False
    with rings[rank].held() as reader:
        return reader is not None and any(ref.version == version for ref in reader.complete())


def _until(what: str, condition: object) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextlib.contextmanager
def _receivers(
    monkeypatch: pytest.MonkeyPatch, address: str, hosts: list[str]
) -> Iterator[list[tuple[WeightReceiver, nn.Module]]]:
    with contextlib.ExitStack() as stack:
        out = []
        for i, host in enumerate(hosts):
            monkeypatch.setenv("WSYNC_HOST_ID", host)
            module = _zeroed()
            # Every other receiver verifies: rank 0 publishes every share's checksums, rank 1's as it noted them.
            receiver = WeightReceiver(module, store=address, job="xshard", name=f"r{i}-{host}", timeout_s=10,
                                      verify=i % 2 == 0)  # fmt: skip
            out.append((stack.enter_context(receiver), module))
        monkeypatch.setenv("WSYNC_HOST_ID", "trainer-a")
        yield out


@pytest.mark.slow
def test_each_rank_relays_its_share_and_every_host_applies_whole_versions_only(server, port, monkeypatch):
    monkeypatch.setenv("WSYNC_HOST_ID", "trainer-a")
    address = f"127.0.0.1:{port}"
    model = _model()
    # Rank 0 waits for a missing share on a thread of its own (heartbeats are read meanwhile: that case,
    # heartbeat_timeout_s below timeout_s, is tests/planes/test_sharded.py's); here the notes across hosts.
    cfg = SenderConfig(job="xshard", timeout_s=3, heartbeat_timeout_s=10)
    mine = prepare_shares(model, cfg, 0, 2)
    theirs = dataclasses.replace(prepare_shares(model, cfg, 1, 2), host="trainer-b")
    writer = ShareWriter(theirs, cfg)
    plan = mine.plan.with_segments(["", writer.name], ["trainer-a", "trainer-b"])
    try:
        with WeightSender(model, store=address, config=cfg, shares=dataclasses.replace(mine, plan=plan)) as sender:
            writer.relay(address, sender.epoch, cfg)
            hosts = ["rollout-1", "rollout-2", "rollout-2", "trainer-b"]
            with _receivers(monkeypatch, address, hosts) as receivers:
                for version in (1, 2):
                    mutate(model, version)
                    assert writer.write(version)
                    handle = sender.push(version)
                    for receiver, module in receivers:
                        assert receiver.wait_for_version(version, timeout_s=_WAIT_S) == version
                        assert digest(module, None) == digest(model, None), receiver.name
                    report = handle.wait(timeout_s=_WAIT_S)
                    assert sorted(report.delivered) == sorted(r.name for r, _ in receivers), report
                    sums = sender._ctl.get_json(keys.version_sums(version))
                    assert isinstance(sums, dict) and len(sums["sums"]) == len(mine.share.buckets) + len(
                        theirs.share.buckets), sums  # rank 0's, then rank 1's (noted from trainer-b)
                described = [r._watcher.source.describe() for r, _ in receivers]  # type: ignore[union-attr]
                assert described == ["relay across hosts, sharded over 2 trainer ranks (2 streams relayed)"] * 3 + [
                    "relay across hosts, sharded over 2 trainer ranks (1 streams relayed)"]
                held = digest(model, None)

                mutate(model, 3)  # rank 1 never writes its share of 3: rank 0's share arrives, nobody applies it
                handle = sender.push(3)
                for receiver, module in receivers[:3]:
                    _until(f"{receiver.name}'s ring of rank 0's stream to hold version 3",
                           lambda r=receiver: _stream_holds(r, 0, 3))  # fmt: skip
                    assert receiver.update() is None and receiver.version == 2
                    assert digest(module, None) == held
                report = handle.wait(timeout_s=_WAIT_S)  # rank 0 reads rank 1's notes on the store: it names rank 1
                assert report.delivered == () and sorted(report.failed) == sorted(r.name for r, _ in receivers)
                for why in report.failed.values():
                    assert "trainer rank 1 did not complete its share of version 3 within timeout_s=3" in why, report

                mutate(model, 4)  # both write 4: the next whole version is applied everywhere
                assert writer.write(4)
                handle = sender.push(4)
                for receiver, module in receivers:
                    assert receiver.wait_for_version(3, timeout_s=_WAIT_S) == 4
                    assert digest(module, None) == digest(model, None), receiver.name
                assert sorted(handle.wait(timeout_s=_WAIT_S).delivered) == sorted(r.name for r, _ in receivers)
    finally:
        writer.close()


def _one_chunk_model() -> nn.Module:
    """Shares of one relay chunk each: a tree gets no chunk of them (its half of a delta is empty)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def _zeroed_one_chunk_model() -> nn.Module:
    model = _one_chunk_model()
    for t in model.state_dict().values():
        t.zero_()
    return model


@pytest.mark.slow
@pytest.mark.parametrize(("size", "delta"), [("2mib", "auto"), ("2mib", "always"), ("one-chunk", "always")])
def test_with_cross_host_tree_each_rank_relays_its_share_down_two_trees_to_verifying_hosts(
    server, port, monkeypatch, size, delta
):
    """cross_host='tree': every stream (rank 0's and rank 1's) takes the unsharded relay's trees over 4 rollout
    hosts; every receiver verifies every share against its rank's checksums and applies each version bit-exact.
    ``one-chunk``: before, a delta's empty half (a tree with no chunk) stalled every version after the first."""
    monkeypatch.setenv("WSYNC_HOST_ID", "trainer-a")
    address = f"127.0.0.1:{port}"
    build, zeroed = (_model, _zeroed) if size == "2mib" else (_one_chunk_model, _zeroed_one_chunk_model)
    model = build()
    cfg = SenderConfig(job="xshard", timeout_s=10, heartbeat_timeout_s=10, cross_host="tree", delta=delta)
    mine = prepare_shares(model, cfg, 0, 2)
    theirs = dataclasses.replace(prepare_shares(model, cfg, 1, 2), host="trainer-b")
    writer = ShareWriter(theirs, cfg)
    plan = mine.plan.with_segments(["", writer.name], ["trainer-a", "trainer-b"])
    try:
        with WeightSender(model, store=address, config=cfg, shares=dataclasses.replace(mine, plan=plan)) as sender:
            writer.relay(address, sender.epoch, cfg)
            hosts = [f"rollout-{h}" for h in range(1, 5)]
            with contextlib.ExitStack() as stack:
                receivers = []
                for host in hosts:
                    monkeypatch.setenv("WSYNC_HOST_ID", host)
                    module = zeroed()
                    receiver = WeightReceiver(module, store=address, job="xshard", name=f"r-{host}", timeout_s=10,
                                              verify=True)  # fmt: skip
                    receivers.append((stack.enter_context(receiver), module))
                monkeypatch.setenv("WSYNC_HOST_ID", "trainer-a")
                streams = [keys.relay_stream(sender.epoch, rank) for rank in (0, 1)]
                _until("both streams' trees over the 4 rollout hosts' leaders", lambda: all(
                    (c := sender._ctl.get_record(keys.relay_chain(s), ChainRecord)) is not None and c.tree
                    and len(c.rids) == 4 for s in streams))  # fmt: skip
                for version in (1, 2, 3):
                    mutate(model, version)
                    assert writer.write(version)
                    handle = sender.push(version)
                    for receiver, module in receivers:
                        assert receiver.wait_for_version(version, timeout_s=_WAIT_S) == version
                        assert digest(module, None) == digest(model, None), (receiver.name, version)
                    report = handle.wait(timeout_s=_WAIT_S)
                    assert sorted(report.delivered) == sorted(r.name for r, _ in receivers), report
                    sums = sender._ctl.get_json(keys.version_sums(version))
                    assert isinstance(sums, dict) and len(sums["sums"]) == len(mine.share.buckets) + len(
                        theirs.share.buckets), sums  # every rank's checksums, which each receiver checked
                for s in streams:  # still the trees: no hop failed and fell back to a chain
                    chain = sender._ctl.get_record(keys.relay_chain(s), ChainRecord)
                    assert chain is not None and chain.tree and len(chain.rids) == 4, (s, chain)
    finally:
        writer.close()
