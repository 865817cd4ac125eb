"""Trees over NIXL: ``WeightSender(transport='nixl', cross_host='tree')`` to four simulated hosts.
The relay keeps a tree on the store; each host's leader READs every version from its parent in
the binary heap over the leaders (the first from the trainer's ring), bit-exact (issue 30)."""

from __future__ import annotations

import queue
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from _nixl_workers import remote_receiver_main
from _spawn import CTX
from _workers import Inbox, build, collect, digest, mutate

from lightning_wsync import WeightSender
from lightning_wsync._control.store import Control
from lightning_wsync._planes.nixl.agent import unusable
from lightning_wsync._planes.relay.hops import read_chain

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow,
              pytest.mark.skipif(unusable() is not None, reason=f"{unusable()}")]  # fmt: skip
SPEC = ("big", 8)  # two 4 MiB chunk READs a hop


def test_four_hosts_in_a_tree_over_nixl_each_reads_from_its_parent_bit_exact(children, port):
    model = build(SPEC)
    results = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    names = ("h0", "h1", "h2", "h3")
    reading: set[tuple[int, int | None]] = set()  # (leader rid, its upstream's rid) as each hop READs
    with WeightSender(model, store=store, job="nxt", transport="nixl", cross_host="tree", timeout_s=20) as sender:
        says = {"hop_chunk_delay_s": 0.0, "hop_slow_from": 1}  # each hop: (rid, upstream) at each version's start
        for name in names:
            p = CTX.Process(target=remote_receiver_main, daemon=True,
                            args=(store, "nxt", name, SPEC, results.queue(name), dict(says)))  # fmt: skip
            p.start()
            children.track(p.pid)
        collect(results, "ready", set(names), timeout_s=120)
        for version in (1, 2, 3):
            mutate(model, version)
            want = digest(model)
            sender.push(version)
            got: dict[str, tuple[int, str]] = {}
            deadline = time.monotonic() + 60
            while len(got) < len(names):
                assert time.monotonic() < deadline, f"version {version}: only {got}"
                for name in names:
                    try:
                        msg = results.queues[name].get(timeout=0.01)
                    except queue.Empty:
                        continue
                    assert msg[0] != "error", msg
                    if msg[0] == "version" and msg[2] == version:
                        got[name] = (msg[2], msg[3])
                    elif msg[0] == "hop-reading" and msg[2] == 3:  # the tree formed by then
                        reading.add((msg[3], msg[4]))
            assert got == {n: (version, want) for n in names}
        ctl = Control(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)), "nxt")
        tree = read_chain(ctl, sender.epoch)
        assert tree is not None and tree.tree and len(tree.rids) == 4
        r = tree.rids  # the binary heap: r0 under the trainer, r1 and r2 under r0, r3 under r1
        assert reading == {(r[0], None), (r[1], r[0]), (r[2], r[0]), (r[3], r[1])}, (reading, r)
