"""Garbled records of NIXL relay hops, through the public surface (``WeightSender(transport='nixl',
cross_host='chain')``, receivers on simulated hosts): the records a hop reads to reach its upstream's
agent and ring (``nixl/<stream>/agent/leader<rid>``, the trainer's ``.../sender``) and the one its
upstream reads to answer it (``.../h<rid>``). Garbage in one stops only the hop that reads it, said
once (a WARNING, then DEBUG while it stays), never a thread's death; the others go on; the hop
follows once the record is back (issue 30)."""

from __future__ import annotations

import logging
import time

from _nixl_run import SLOW_NIXL, Run

from lightning_wsync._control import keys
from lightning_wsync._planes.nixl.lend import owner_key

pytestmark = SLOW_NIXL
SPEC = ("big", 8)  # two 4 MiB chunk READs a hop
TIMEOUT_S = 3.0
WATCH = {"forward_logs": True, "report_left": True}


def test_garbled_records_between_two_leaders_stop_only_that_hop_said_once_and_it_follows(children, port):
    """The middle leader's owner record garbled as a third host joins the chain: only the third waits
    (the two upstream apply every version within ``timeout_s``); the record back, the third loads it
    and pins, but its own reader record, garbled meanwhile, makes the middle leader ignore it: it waits
    again; that record back too, it applies the newest version bit-exact."""
    run = Run(children, port, "nxgr", SPEC, cross_host="chain", timeout_s=TIMEOUT_S)
    try:
        run.start(("h0", "h1"), WATCH)
        run.push(1)
        run.until(("h0", "h1"), 1, 120)
        r = run.chain(2, 60).rids
        head, middle = run.names()[r[0]], run.names()[r[1]]
        lent = owner_key(run.sender.epoch, r[1])
        good = run.garble(lent)  # what the middle leader's hop owner wrote: its agent, its ring's regions
        run.start(("h2",), WATCH)
        three = run.chain(3, 60).rids
        assert three[:2] == r, (r, three)
        reader = keys.nixl_agent(run.sender.epoch, f"h{three[2]}")  # the third leader's, read by the middle's owner

        def failed(name: str, text: str, times: int) -> None:
            run.wait(lambda: len(run.said(name, text)) >= times, 60, f"{name} never said {text!r} {times} times")

        failed("h2", f"agent/leader{r[1]}", 3)  # its hop tried (and failed) three times: alive, waiting
        run.push(2)
        assert run.until((head, middle), 2, 30) < TIMEOUT_S  # the others go on
        assert run.seen["h2"] == []
        assert len(run.said("h2", f"agent/leader{r[1]}", "WARNING")) == 1, run.said("h2", "")
        mine = run.garble(reader)
        run.garble(lent, good)  # its writer's record again: the third loads it and pins, and is ignored
        failed(middle, f"ignoring agent 'wsync-h{three[2]}-", 2)
        failed("h2", "no answer to a pin", 2)
        run.push(3)
        assert run.until((head, middle), 3, 30) < TIMEOUT_S
        assert run.seen["h2"] == []
        assert len(run.said(middle, f"ignoring agent 'wsync-h{three[2]}-", "WARNING")) == 1, run.said(middle, "")
        assert len(run.said("h2", "no answer to a pin", "WARNING")) == 1, run.said("h2", "")
        run.garble(reader, mine)  # back: the middle's owner loads it at the next pin
        run.until(("h2",), 3, 30)
        assert run.seen["h2"] == [(3, run.pushed[3])]
        run.push(4)
        run.until(("h0", "h1", "h2"), 4, 30)
        run.close(("h0", "h1", "h2"))
        assert run.segments() == []
    finally:
        run.sender.close()


def test_a_garbled_record_of_the_first_hop_stops_only_it_and_it_follows_once_restored(children, port, caplog):
    """The trainer's record garbled: the first leader waits, a receiver on the trainer's host does not.
    The first leader's own record garbled meanwhile, the trainer's back: the trainer's owner ignores it
    (said once) and it waits on; its record back, the trainer's owner answers it and it follows."""
    caplog.set_level(logging.DEBUG, logger="lightning_wsync._planes.nixl")
    run = Run(children, port, "nxgf", SPEC, cross_host="chain", timeout_s=TIMEOUT_S)
    try:
        trainer = keys.nixl_agent(run.sender.epoch, "sender")
        good = run.garble(trainer)
        run.start(("local",), {}, local=True)
        run.start(("h0",), WATCH)
        (first,) = run.chain(1, 60).rids
        run.push(1)
        run.until(("local",), 1, 30)
        run.wait(lambda: len(run.said("h0", "agent/sender")) >= 2, 60, "the first leader never failed twice")
        assert len(run.said("h0", "agent/sender", "WARNING")) == 1, run.said("h0", "")
        mine = run.garble(keys.nixl_agent(run.sender.epoch, f"h{first}"))
        run.garble(trainer, good)
        run.wait(lambda: len(run.said("h0", "no answer to a pin")) >= 2, 60, "the first leader was answered")
        refused = [r for r in caplog.records if f"ignoring agent 'wsync-h{first}-" in r.getMessage()]
        assert [r.levelname for r in refused][:1] == ["WARNING"] and len(refused) >= 2, refused
        assert [r.levelname for r in refused[1:]] == ["DEBUG"] * (len(refused) - 1), refused  # said once
        run.push(2)
        run.until(("local",), 2, 30)
        assert run.seen["h0"] == []
        run.garble(keys.nixl_agent(run.sender.epoch, f"h{first}"), mine)
        start = time.monotonic()
        run.until(("h0",), 2, 30)
        assert run.seen["h0"] == [(2, run.pushed[2])], run.seen["h0"]
        print(f"\nthe first leader applied version 2 {time.monotonic() - start:.2f} s after its record was back")
        run.close(("h0",))
    finally:
        run.sender.close()
