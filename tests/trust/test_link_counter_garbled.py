"""A receiver's network link counter (``member/<rid>/net``) garbled by a store writer: the
receiver's link thread reports it once and goes on, and the sender still follows the other
receivers (issue 32: every background thread keeps serving)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.distributed as dist

from lightning_wsync._control import keys
from lightning_wsync._control.checks import parse_counter
from lightning_wsync._control.manifest import build_manifest
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import timing
from lightning_wsync._planes.base import Peer
from lightning_wsync._planes.delta.encode import AutoPolicy
from lightning_wsync._planes.net.link import NetReceiveLink
from lightning_wsync._planes.net.send import NetSendPlane
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync.errors import WeightSyncRecordError


def test_a_garbled_link_counter_is_reported_once_and_the_link_thread_goes_on(
    server: dist.TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, ``Control.add`` raised ``WeightSyncRecordError`` out of the link's thread, which died
    (an ``Exception in thread`` on stderr; no network version ever again). Now it is reported with
    its traceback, once, the counter is written back past the last number taken, and the thread
    takes its next link number (its group then waits for a sender that never comes: rebuilt)."""
    ctl = Control(server, "garbled")
    ctl.set_text(keys.member_link(5), "\u00b2")
    layout = build_manifest({"w": torch.zeros(1000)}, torch.float32, bucket_bytes=1 << 12)
    caplog.set_level(logging.DEBUG)
    link = NetReceiveLink(ctl, layout, epoch=1, rid=5, backend="gloo", addr="127.0.0.1", timeout_s=0.5,
                          device=torch.device("cpu"), on_staged=lambda v: None,
                          on_rejected=lambda v, why: None)  # fmt: skip
    try:
        deadline = time.monotonic() + 15
        while parse_counter((ctl.get_text(keys.member_link(5)) or "").encode()) in (None, 0):
            assert link._thread.is_alive(), "the link's thread died on the garbled counter"
            assert time.monotonic() < deadline, "no link number taken within 15 s"
            time.sleep(0.05)
        assert link._thread.is_alive()
    finally:
        link.close()
    reports = [r for r in caplog.records if r.levelno >= logging.ERROR and "not an integer" in r.getMessage()]
    assert len(reports) == 1 and reports[0].exc_info is not None, [r.getMessage() for r in caplog.records]


def test_one_receivers_garbled_link_counter_never_stops_the_sender_following_the_others(server: dist.TCPStore) -> None:
    """The send side reads every live receiver's ``member/<rid>/net``; before, the first garbled one
    raised out of the pass and every receiver after it got no link (in every pass while it stayed
    garbled). Now the others are followed and the error is raised after the pass (the sender's
    thread reports it once, as a bad record)."""
    ctl = Control(server, "garbled")
    ctl.set_text(keys.member_link(1), "\u00b2")
    ctl.set_text(keys.member_link(2), "1")
    weights = torch.zeros(1000)
    layout = build_manifest({"w": weights}, None, 1 << 12)
    ring = SnapshotRing(layout, segment=None, device=torch.device("cpu"), slots=2, lease_s=1.0)
    plane = NetSendPlane(ctl, ring, epoch=1, backend="gloo", addr="127.0.0.1",
                         timing=timing(heartbeat_timeout_s=2.0, timeout_s=0.5), deltas=None,
                         policy=AutoPolicy("off"))  # fmt: skip
    peers = [Peer(rid, f"r{rid}", "elsewhere", False) for rid in (1, 2)]
    try:
        with pytest.raises(WeightSyncRecordError, match="not an integer"):
            plane.sync(peers, [], [])
        assert plane.links() == 1 and 2 in plane._links, "the receiver after the garbled one got no link"
    finally:
        plane.stop()
        assert not plane.close(time.monotonic() + 5)
