"""A NIXL relay chain under failure, through the public surface (``WeightSender(transport='nixl',
cross_host='chain')``, receivers on three simulated hosts, each its host's leader): the middle
leader SIGKILLed, or SIGSTOPped past every timeout, while the tail leader READs the version it is
still writing. The tail applies nothing torn, follows the chain re-formed behind the head, and
everyone is current after; and a slot rewritten under a slow downstream hop's READ is dropped by
its header re-read and READ again (issue 30)."""

from __future__ import annotations

import os
import signal
import time

from _nixl_run import BIG, LOST, SLOW_NIXL, Run
from _spawn import CTX

pytestmark = SLOW_NIXL
NAMES = ("h0", "h1", "h2")
TIMEOUT_S, HEARTBEAT_TIMEOUT_S = 4.0, 2.0


@LOST
def test_middle_leader_lost_mid_read_the_tail_applies_nothing_torn_and_follows(children, port, stop):
    run = Run(children, port, f"nxf{int(stop)}", BIG, cross_host="chain", timeout_s=TIMEOUT_S,
              heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)  # fmt: skip
    try:
        # Every hop slowed from version 2 on: ~2 s a version, so a signal lands mid-READ.
        run.start(NAMES, {"hop_chunk_delay_s": 0.25})
        run.push(1)
        run.until(NAMES, 1, 120)
        run.push(2)
        r = run.chain(3, 60).rids
        run.hop_reading(2, r[2], r[1], 60)  # the tail READs version 2 as the middle still writes it
        head, middle, tail = (run.names()[rid] for rid in r)
        os.kill(run.procs[middle].pid, stop)
        # Past every timeout (the hop's, the heartbeat's, the lease's): the chain re-forms behind the head.
        start = time.monotonic()
        run.push(3)
        run.until((head, tail), 3, 60)
        assert time.monotonic() - start < 60
        if stop == signal.SIGSTOP:  # resumed: nothing it held half-read is applied; it follows again
            time.sleep(max(0.0, start + TIMEOUT_S + 1 - time.monotonic()))  # stopped past every timeout, not sync
            os.kill(run.procs[middle].pid, signal.SIGCONT)
        run.push(4)
        live = NAMES if stop == signal.SIGSTOP else (head, tail)
        run.until(live, 4, 90)
        assert {n: run.seen[n][-1] for n in live} == {n: (4, run.pushed[4]) for n in live}
        # Nothing torn: the tail applied version 2 only bit-exact (checked in until) or not at all.
        assert [v for v, _ in run.seen[tail]] in ([1, 2, 3, 4], [1, 3, 4]), run.seen[tail]
    finally:
        run.sender.close()


def test_a_slot_rewritten_under_a_slow_hop_reader_is_dropped_by_its_header_re_read_and_read_again(children, port):
    """The downstream leader's hop stalls (its thread only: its heartbeats go on) after the first chunk of
    version 2, READ from its upstream leader's ring, until the upstream has written a newer version into
    that very slot (the stalled READ's lease lapsed after ``heartbeat_timeout_s``, the host ring's
    ``lease_s``). Resumed within ``timeout_s``, the hop finishes its READ, finds the slot's words moved,
    drops the copy (no rejection) and READs the newest version: only bit-exact versions are applied."""
    hold = CTX.Event()
    run = Run(children, port, "nxrw", BIG, cross_host="chain", timeout_s=10.0, heartbeat_timeout_s=2.0)
    try:
        run.start(("h0", "h1"), {"hop_hold": hold, "hop_hold_version": 2, "forward_logs": True,
                                 "report_left": True})  # fmt: skip
        run.push(1)
        run.until(("h0", "h1"), 1, 120)
        r = run.chain(2, 60).rids
        run.push(2)
        slot = run.hop_reading(2, r[1], r[0], 60)[5]  # the downstream READs version 2 from this slot, then holds
        up, down = run.names()[r[0]], run.names()[r[1]]
        version, deadline = 2, time.monotonic() + 60
        while not any(m[1] == up and m[2] > 2 and m[3] == slot for m in run.published):  # until it is rewritten
            assert time.monotonic() < deadline, f"{up} never rewrote slot {slot}: {run.published}"
            version += 1
            run.push(version)
            run.wait(lambda v=version: any(m[1] == up and m[2] == v for m in run.published), 30,
                     f"{up} never published version {version}")  # fmt: skip
        hold.set()
        run.until((up, down), version, 30)
        moved = [m for m in run.logs if m[1] == down and "version 2's slot moved during the READ" in m[3]]
        assert moved, [m for m in run.logs if m[1] == down]
        assert not [m for m in run.logs if m[1] == down and m[2] == "WARNING"], run.logs  # dropped, not failed
        assert 2 not in [v for v, _ in run.seen[down]], run.seen[down]
        run.push(version + 1)  # current again
        run.until((up, down), version + 1, 30)
        run.close(("h0", "h1"))
        assert run.segments() == []
    finally:
        hold.set()
        run.sender.close()
