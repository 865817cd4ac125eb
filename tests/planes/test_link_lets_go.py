"""A stopped network link lets go of its snapshot slots at once, even while its send is blocked.

Seen in tests/reliability/test_chaos.py (r0 held 11, not 12): two receivers killed
mid-send left their links blocked in gloo sends until gloo's own timeout_s (the
sender's interrupt did not end them); the sender had dropped both links, but their
leases still held both snapshot slots, so the last push was dropped ("every snapshot
slot is being read") and no receiver ever got it. Here the send is held where no
interrupt reaches (the checksum pass), which makes the order of events certain.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _spawn import CTX
from conftest import Children

from lightning_wsync._control import keys
from lightning_wsync._control.manifest import build_manifest
from lightning_wsync._control.store import Control
from lightning_wsync._planes.delta.wire import ready_note
from lightning_wsync._planes.net.sendlink import NetSendLink
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync._planes.wire import HEADER_WORDS, make_group

pytestmark = pytest.mark.timeout(90)
JOB, EPOCH, RID, NUMBER = "letgo", 1, 0, 1
PREFIX = keys.link_prefix(EPOCH, RID, NUMBER)
GLOO_TIMEOUT_S = 60.0  # far beyond the test: only stop() can free the slot in time


def _peer(port: int, conn: Any) -> None:
    """Join the link's group, ask for a version and take its header, then nothing more until told to exit."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    ctl = Control(store, JOB)
    pg = make_group("gloo", ctl.prefix_store(PREFIX), 1, "127.0.0.1", GLOO_TIMEOUT_S)
    ctl.set_text(keys.ready(PREFIX, 0), ready_note(None, None))
    pg.recv([torch.empty(HEADER_WORDS, dtype=torch.int64)], 0, 0).wait()
    conn.send("joined")
    conn.recv()  # the test is done with the blocked send
    del pg


def test_stopped_link_frees_its_slot_while_its_send_is_blocked(port: int, children: Children) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ctl = Control(store, JOB)
    weights = torch.arange(1 << 18, dtype=torch.float32)
    layout = build_manifest({"w": weights}, None, 1 << 20)
    ring = SnapshotRing(layout, segment=None, device=torch.device("cpu"), slots=2, lease_s=GLOO_TIMEOUT_S)
    assert ring.write(1, [weights]) is not None
    in_send, go_on = threading.Event(), threading.Event()
    checksums = ring.checksums

    def held_up(lease: Any) -> list[int] | None:  # runs in the link's thread, mid-send, lease held
        in_send.set()
        go_on.wait(30)
        return checksums(lease)

    ring.checksums = held_up  # type: ignore[method-assign]
    here, there = CTX.Pipe()
    peer = CTX.Process(target=_peer, args=(port, there), daemon=True)
    peer.start()
    children.track(peer.pid or 0)
    link = NetSendLink(ctl, ring, epoch=EPOCH, rid=RID, number=NUMBER, backend="gloo", addr="127.0.0.1",
                       timeout_s=GLOO_TIMEOUT_S)  # fmt: skip
    try:
        assert here.poll(30) and here.recv() == "joined"
        assert in_send.wait(30), "the link never started its send"
        assert ring.describe().count("leases 1") == 1, ring.describe()
        link.stop()
        assert ring.describe().count("leases 0") == 2, ring.describe()
        # Both slots take pushes now; the stopped send's trailer would say "superseded".
        assert ring.write(2, [weights + 1]) is not None and ring.write(3, [weights + 2]) is not None
    finally:
        link.stop()
        go_on.set()
        here.send("exit")
        peer.join(30)
        assert link.join(30), "the link's thread outlived its peer"
        ring.close()
