"""A leader dropped from the relay's chain comes back only once its heartbeat has moved since.

Time alone re-admitted a SIGKILLed leader: the membership counts a leader dead only
``heartbeat_timeout_s`` after it *saw* its last beat, which can be after the hop to it failed,
and ``tests/multihost/test_multihost_relay_tree_deltas.py`` showed the dead leader back in the
trees 2.0 s after its drop and out again 0.2 s later (two re-forms, the newest version sent
again). Here the real head, on a real store, is handed the live leaders as the sender's
membership would hand them.
"""

from __future__ import annotations

import time

import torch

from lightning_wsync._control import keys
from lightning_wsync._control.manifest import build_manifest
from lightning_wsync._control.store import Control
from lightning_wsync._control.timing import timing
from lightning_wsync._planes.relay.head.feed import RelayHead
from lightning_wsync._planes.relay.hops import Stream, mark_broken
from lightning_wsync._planes.shm.ring import SnapshotRing

HBT = 0.5  # heartbeat_timeout_s: the drop lasts at least this long


def _head(ctl: Control) -> RelayHead:
    layout = build_manifest({"w": torch.zeros(64)}, None, 1 << 20)
    ring = SnapshotRing(layout, segment=None, device=torch.device("cpu"), slots=2, lease_s=HBT)
    stream = Stream(number=1, backend="gloo", addr="127.0.0.1", timeout_s=2.0)
    return RelayHead(ctl, ring, stream, timing=timing(heartbeat_timeout_s=HBT, timeout_s=2.0), topology="chain")


def _until(what: str, ok, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_dropped_leader_whose_heartbeat_stopped_stays_out_and_one_that_beats_comes_back(server) -> None:
    ctl = Control(server, "readmit")
    head = _head(ctl)
    leaders = {1: "h1", 2: "h2", 3: "h3"}
    try:
        for rid in leaders:
            ctl.add(keys.member_heartbeat(rid), 1)
        head.update_chain(leaders)
        assert head.chain.rids == (1, 2, 3)
        mark_broken(ctl, 1, 2)  # the hops into 2 and 3 failed: 2 is dead, 3 is alive
        mark_broken(ctl, 1, 3)
        dropped = time.monotonic()  # before the call that drops them: it reads its clock first
        head.update_chain(leaders)
        assert head.chain.rids == (1,)

        def beat_three_once_ok() -> bool:
            ctl.add(keys.member_heartbeat(3), 1)  # 3 beats on; 2 never again
            head.update_chain(leaders)  # the membership still lists both (it has not seen 2 stop)
            return 3 in head.chain.rids

        _until("the live leader back in the chain", beat_three_once_ok)
        assert time.monotonic() - dropped >= HBT  # not before heartbeat_timeout_s
        assert head.chain.rids == (1, 3)
        for _ in range(5):  # well past heartbeat_timeout_s: the silent one is still out
            time.sleep(HBT / 2)
            head.update_chain(leaders)
        assert head.chain.rids == (1, 3), head.chain

        # Once it leaves the live leaders and comes back (a new leadership), it is not held out.
        head.update_chain({1: "h1", 3: "h3"})
        head.update_chain(leaders)
        assert head.chain.rids == (1, 3, 2)
    finally:
        head.close()
