"""The sender's sweep deletes every key a replaced chain's hops left, whatever the ``ready`` note's number
(issue 32: the relay chaos run in CI ended with ``relay/1/pg/5/4/ready/2`` on the store).

A hop's downstream leader writes ``ready/<n>`` before each send ``n``, and its upstream takes
(reads and deletes) each note. A note that reaches the store after the upstream left the hop is
the leader's to delete when it leaves the hop too; a leader SIGKILLed first leaves it, and the
sweep, by name, deleted ``ready/0`` of each hop only. The first tests make the two sides' store
requests in that order, on two connections to a real TCPStore, with the sender's own sweeper; the
last has a real sender and two real leader processes do it, the late leader's requests held in a
proxy and the leader stopped and killed at points the test sees on the store.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
import torch.distributed as dist
from _lead_quiet import receiver_main
from test_relay_lead_quiet import _apply, _control
from test_relay_store_load import _wait

from lightning_wsync import WeightSender
from lightning_wsync._control import keys
from lightning_wsync._control.store import Control
from lightning_wsync._planes.relay.head.feed import leader_record
from lightning_wsync._planes.relay.hops import JOINING, TAKEN, read_chain
from lightning_wsync._planes.relay.tidy import RelaySweeper, forget_hop
from lightning_wsync.testing.models import ModelSpec, build_model, digest, mutate
from lightning_wsync.testing.procs import receive
from lightning_wsync.testing.storeproxy import CountingProxy

pytestmark = pytest.mark.timeout(60)

EPOCH, JOB = 1, "sweep"


def _hop_keys(ctl: Control, chain: int | None = None, epoch: int = EPOCH) -> list[str]:
    """The relay hop keys on the store (of chain ``chain``, or of every chain)."""
    names = ctl.list_keys(keys.relay_hops(epoch) + ("" if chain is None else f"{chain}/"))
    assert names is not None
    return sorted(names)


def _served(up: Control, lead: Control, chain: int, rid: int, sends: int) -> str:
    """Hop ``chain`` into leader ``rid`` as both sides leave it after ``sends`` sends: built (both
    marks taken, gloo's keys), and each note the leader wrote before a send taken by its upstream.

    A ``set`` is not answered: what one connection wrote is waited for on the other before it is
    read there (the store orders each connection's requests, not two connections')."""
    prefix = keys.relay_hop_prefix(EPOCH, chain, rid)
    up.set_text(keys.joined(prefix, 0), JOINING)
    lead.set_text(keys.joined(prefix, 1), JOINING)
    assert up.wait_for(keys.joined(prefix, 1), 10) and lead.wait_for(keys.joined(prefix, 0), 10)
    up.compare_set(keys.joined(prefix, 1), JOINING, TAKEN)
    lead.compare_set(keys.joined(prefix, 0), JOINING, TAKEN)
    for name in keys.group_keys(prefix):
        lead.set_text(name, "gloo")
    for n in range(sends):
        lead.set_text(keys.ready(prefix, n), '{"version": null}')
        assert up.wait_for(keys.ready(prefix, n), 10)  # (and the leader's writes before it)
        assert up.get_text(keys.ready(prefix, n)) is not None
        up.delete(keys.ready(prefix, n))  # taken, as wait_ready and Downstream's reader do
    return prefix


@pytest.fixture
def sides(server: dist.TCPStore) -> tuple[Control, Control]:
    """The upstream side's and the leader's connections to one store."""
    up = Control(server, JOB)
    return up, up.clone()


def test_a_note_written_after_the_upstream_left_and_never_taken_is_deleted_by_the_sweep(sides) -> None:
    up, lead = sides
    sweeper = RelaySweeper(EPOCH, linger_s=0.0)  # due at the next sweep: the linger is not what is tested
    prefix = _served(up, lead, chain=5, rid=4, sends=2)
    # Chain 6 replaces chain 5. The upstream leaves first: its note to wait for, ready/2, is not there yet.
    sweeper.replaced(5, (3, 4))
    forget_hop(up, prefix, 0, spent=True, notes=(2,))
    # The leader, done with send 1 meanwhile, writes its note for send 2 (_serve's next step), and is
    # SIGKILLed before it sees chain 6: its forget_hop never runs.
    lead.set_text(keys.ready(prefix, 2), '{"version": 2}')
    assert up.wait_for(keys.ready(prefix, 2), 10)
    assert _hop_keys(up) == ["relay/1/pg/5/4/ready/2"]
    sweeper.sweep(up, leaders={})
    assert _hop_keys(up) == []  # before the fix: ['relay/1/pg/5/4/ready/2'], for good


def test_what_a_side_stopped_past_a_sweep_writes_back_goes_at_the_next_sweep(sides) -> None:
    up, lead = sides
    sweeper = RelaySweeper(EPOCH, linger_s=0.0)
    old = _served(up, lead, chain=5, rid=4, sends=1)
    sweeper.replaced(5, (4,))
    sweeper.sweep(up, leaders={})
    assert _hop_keys(up, 5) == []
    lead.set_text(keys.ready(old, 3), '{"version": 3}')  # a side resumed after the sweep writes its note
    lead.set_text(keys.joined(old, 1), "gone")
    _served(up, lead, chain=6, rid=4, sends=1)
    current = _served(up, lead, chain=7, rid=4, sends=1)
    lead.set_text(keys.ready(current, 1), '{"version": 1}')  # the live chain's note, not yet taken
    assert up.wait_for(keys.ready(current, 1), 10)  # (and the late writes into chain 5 before it)
    sweeper.replaced(6, (4,))
    sweeper.sweep(up, leaders={4: "h"})
    assert _hop_keys(up) == sorted([keys.joined(current, 0), keys.joined(current, 1), *keys.group_keys(current),
                                   keys.ready(current, 1)])  # fmt: skip


def test_the_sweep_lists_the_store_only_when_a_replaced_chain_is_due(sides, monkeypatch) -> None:
    up, lead = sides
    lists: list[str] = []
    real: Callable[[str], list[str] | None] = up.list_keys
    monkeypatch.setattr(up, "list_keys", lambda prefix: lists.append(prefix) or real(prefix))
    sweeper = RelaySweeper(EPOCH, linger_s=3600.0)
    _served(up, lead, chain=1, rid=4, sends=1)
    for _ in range(100):  # idle, or a replaced chain within its linger: no list request
        sweeper.sweep(up, leaders={4: "h"})
    sweeper.replaced(1, (4,))
    sweeper.sweep(up, leaders={4: "h"})
    assert lists == []
    sweeper.close(up, 2, (4,))  # the sender leaves: one list for every chain it had
    assert lists == [keys.relay_hops(EPOCH)]
    assert _hop_keys(up) == []


def test_a_store_that_cannot_list_its_keys_has_each_hop_deleted_by_name() -> None:
    ctl = Control(dist.HashStore(), JOB)
    assert ctl.list_keys("") is None
    sweeper = RelaySweeper(EPOCH, linger_s=0.0)
    prefix = _served(ctl, ctl, chain=5, rid=4, sends=1)
    ctl.set_text(keys.ready(prefix, 1), '{"version": 1}')
    sweeper.replaced(5, (4,))
    sweeper.sweep(ctl, leaders={})
    named = [keys.joined(prefix, 0), keys.joined(prefix, 1), *keys.group_keys(prefix), keys.ready(prefix, 1)]
    assert [name for name in named if ctl.has(name)] == [keys.ready(prefix, 1)]  # the marks, gloo's keys: gone


TINY = ModelSpec(d_model=16, vocab=64, n_layers=1)  # 17 KB
HEARTBEAT_TIMEOUT_S = 6.0
TIMEOUT_S = 5.0  # with the heartbeat timeout, how long a replaced chain's hops linger (11 s)
SLACK_S = 10.0  # membership refreshes and a loaded machine
NOTE, RECEIPT = "relay/#/pg/#/#/ready/#", "relay/#/received/#"  # key shapes, as the proxies count them


def _asked(proxy: CountingProxy, command: str, shape: str) -> int:
    """How many ``command`` requests on keys of ``shape`` the process behind ``proxy`` sent."""
    return sum(n for k, n in proxy.snapshot_keys().items() if k.split(" ", 1)[0] == command
               and k.split("/", 3)[-1] == shape)  # fmt: skip


def _noted(proxy_b: CountingProxy, versions: int) -> int | None:
    """How many notes leader b (the tail: one hop, joined once) wrote once it has taken ``versions``
    sends and written its note after each (and one as it joined); None before."""
    notes, receipts = _asked(proxy_b, "set", NOTE), _asked(proxy_b, "set", RECEIPT)
    return notes if receipts >= versions and notes == receipts + 1 else None


def _taken(proxy_b: CountingProxy, proxy_a: CountingProxy, versions: int) -> bool:
    """As :func:`_noted`, and its upstream a took every note (a ``get`` is a compare-and-set that never writes)."""
    return _noted(proxy_b, versions) == _asked(proxy_a, "compare_set", NOTE)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_leaders_note_that_lands_after_its_upstream_left_goes_with_the_replaced_chain(
    children, monkeypatch, port
) -> None:
    """Leader b's note for its next send reaches the store after its upstream a left the hop (b's
    requests held in its proxy meanwhile: a leader slow to write it), and b is SIGKILLed before it
    sees the new chain and deletes the note itself. The sender's sweep deletes it with the hop."""
    model = build_model(TINY, seed=0)
    job = f"note-{port}"
    ctl = _control(port, job)
    with CountingProxy("127.0.0.1", port) as proxy_a, CountingProxy("127.0.0.1", port) as proxy_b:
        with monkeypatch.context() as env:
            env.setenv("WSYNC_HOST_ID", "trainer-host")
            sender = WeightSender(model, store=f"127.0.0.1:{port}", job=job, timeout_s=TIMEOUT_S, cross_host="relay",
                                  heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, delta="off")  # fmt: skip
        with sender:
            mutate(model, 1)
            sender.push(1)
            a = children.start(receiver_main, (proxy_a.address, job, "na", "simhost-na", TINY), name="wsync-test-na")
            rid_a = receive(a, 60, "host a's receiver")[1]
            _wait("host a's leader", lambda: leader_record(ctl, sender.epoch, "simhost-na"))
            b = children.start(receiver_main, (proxy_b.address, job, "nb", "simhost-nb", TINY), name="wsync-test-nb")
            rid_b = receive(b, 60, "host b's receiver")[1]
            chain = _wait("the chain a -> b", lambda: (c := read_chain(ctl, sender.epoch)) is not None
                          and c.rids == (rid_a, rid_b) and not c.tree and c)  # fmt: skip
            pid_b = children.pids[1]
            hop = keys.relay_hop_prefix(sender.epoch, chain.number, rid_b)  # the hop a -> b
            gen = (chain.number, sender.epoch)
            _apply((a, b), 1, digest(model))
            mutate(model, 2)
            sender.push(2)
            _apply((a, b), 2, digest(model))
            _wait("b's note after version 2, taken by a", lambda: _taken(proxy_b, proxy_a, 2))
            proxy_b.hold()  # b's requests reach the store only at release()
            mutate(model, 3)
            sender.push(3)
            _apply((a,), 3, digest(model))
            notes = _wait("b's note after version 3, sent", lambda: _noted(proxy_b, 3))  # and held in the proxy
            os.kill(pid_b, signal.SIGSTOP)
            # b's heartbeat is held too: the sender drops it, and a leaves the hop, deleting its keys and
            # the note it waited for, which is not there yet.
            _wait("a to leave the hop to b", lambda: not ctl.has(keys.joined(hop, 0))
                  and not ctl.list_keys(hop + "ready/"), HEARTBEAT_TIMEOUT_S + SLACK_S)  # fmt: skip
            proxy_b.release()
            left = _wait("b's note to land", lambda: ctl.list_keys(hop + "ready/"))
            assert left == [keys.ready(hop, notes - 1)] and notes > 1, left  # not ready/0: the old sweep kept it
            os.kill(pid_b, signal.SIGKILL)  # before it sees the new chain and deletes its note
            _wait("the chain to be replaced", lambda: (c := read_chain(ctl, sender.epoch)) is None
                  or c.number != chain.number)  # fmt: skip
            replaced = time.monotonic()  # (seen here a little after the sender replaced it)
            bound = TIMEOUT_S + HEARTBEAT_TIMEOUT_S + SLACK_S
            try:
                _wait("the replaced chain's hops to be deleted", lambda: not _hop_keys(ctl, *gen), bound)
            except AssertionError:
                pytest.fail(f"left {bound} s after chain {chain.number} was replaced: {_hop_keys(ctl, *gen)}")
            print(f"chain {chain.number}'s hops, {left[0]} included: deleted {time.monotonic() - replaced:.1f} s after "
                  f"it was replaced (linger {TIMEOUT_S + HEARTBEAT_TIMEOUT_S} s)")  # fmt: skip
