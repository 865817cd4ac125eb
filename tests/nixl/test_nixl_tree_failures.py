"""One NIXL tree under failure, through the public surface (``WeightSender(transport='nixl',
cross_host='tree')``, receivers on four simulated hosts, each its host's leader): an inner leader
(the root's first child, itself the parent of the fourth) SIGKILLed, or SIGSTOPped past every
timeout and then SIGCONTed, while its child READs from it the version it is still writing. Nothing
torn is applied anywhere, its child re-parents and follows within ``timeout_s``, the other leaders
are not held up, and nothing is left behind (issue 30)."""

from __future__ import annotations

import os
import signal
import time

from _nixl_run import BIG, LOST, SLOW_NIXL, Run

from lightning_wsync._planes.shm.files import remove_stale_segments

pytestmark = SLOW_NIXL
NAMES = ("h0", "h1", "h2", "h3")
TIMEOUT_S, HEARTBEAT_TIMEOUT_S = 6.0, 2.0


@LOST
def test_an_inner_leader_lost_mid_read_its_child_reparents_and_nobody_applies_anything_torn(children, port, stop):
    run = Run(children, port, f"nxtf{int(stop)}", BIG, cross_host="tree", timeout_s=TIMEOUT_S,
              heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)  # fmt: skip
    try:
        # Every hop slowed at version 2 only (~2 s a hop), so the signal lands mid-READ; the rest at full speed.
        run.start(NAMES, {"hop_chunk_delay_s": 0.25, "hop_slow_versions": [2], "report_left": True})
        run.push(1)
        run.until(NAMES, 1, 120)
        tree = run.chain(4, 60)
        assert tree.tree, tree
        r = tree.rids  # the binary heap: r0 under the trainer, r1 and r2 under r0, r3 under r1
        run.push(2)
        run.hop_reading(2, r[3], r[1], 60)  # r3 READs version 2 from r1, which still READs it from r0
        names = run.names()
        inner, child, others = names[r[1]], names[r[3]], (names[r[0]], names[r[2]])
        os.kill(run.procs[inner].pid, stop)
        fault = time.monotonic()
        run.push(3)
        # Not held up: the root and its other child never wait on the lost leader (a lease, a pin, a hop).
        took = run.until(others, 3, 60)
        assert took < TIMEOUT_S, f"{others} took {took:.2f} s for version 3"
        run.until((child,), 3, 60)
        reparented = time.monotonic() - fault
        print(f"\n{signal.Signals(stop).name}: {child} applied version 3 {reparented:.2f} s after the fault, "
              f"{others} {took:.2f} s after its push (timeout_s={TIMEOUT_S})")  # fmt: skip
        assert reparented < TIMEOUT_S, reparented
        run.hop_reading(3, r[3], r[0], 10)  # re-parented: READs from the root
        now = run.chain(3, 30)  # the tree re-formed without the lost leader: its child now under the root
        assert now.tree and r[1] not in now.rids and now.rids[0] == r[0], now
        # Nothing torn: version 2 whole and bit-exact (checked in until) or not at all.
        assert [v for v, _ in run.seen[child]] in ([1, 2, 3], [1, 3]), run.seen[child]
        if stop == signal.SIGSTOP:  # stopped past every timeout: the fault's length, not a sync
            time.sleep(max(0.0, fault + TIMEOUT_S + 1 - time.monotonic()))
            os.kill(run.procs[inner].pid, signal.SIGCONT)
        live = NAMES if stop == signal.SIGSTOP else (*others, child)
        run.push(4)
        run.until(live, 4, 60)
        assert {n: run.seen[n][-1] for n in live} == {n: (4, run.pushed[4]) for n in live}
        if stop == signal.SIGSTOP:  # the resumed leader applied nothing it held half-read
            assert [v for v, _ in run.seen[inner]] in ([1, 4], [1, 2, 4], [1, 2, 3, 4], [1, 3, 4]), run.seen[inner]
        run.close(live)
        if stop == signal.SIGKILL:  # a killed leader's ring stays until the next leader on the machine tidies
            assert [n for n in run.segments() if not n.startswith(f"wsync-{run.procs[inner].pid}-")] == []
            remove_stale_segments()
        assert run.segments() == []
    finally:
        run.sender.close()
