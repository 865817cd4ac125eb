"""A SIGKILLed sender's relay keys are deleted by its successor (issue 32, the chaos runs' store
growing by ~10 keys per trainer relaunch).

A killed sender cannot delete its epoch's ``relay/<epoch>/`` keys (its chain, ``moved``, the
bells its successor rings, leader records and receipts of leaders that died with it, hops of
chains it replaced). Its successor deletes them once nobody can still use them: ``timeout_s +
heartbeat_timeout_s`` of the dead sender after the successor started (by then every leader of
the dead epoch has followed the new sender, or its hop has timed out); epochs two or more back
at once, with their records. Asserted on the store's own list of keys.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist
from _lead_quiet import receiver_main, sender_main
from test_relay_lead_quiet import _apply, _control
from test_relay_store_load import _wait

from lightning_wsync import WeightSender
from lightning_wsync._planes.relay.hops import read_chain
from lightning_wsync.testing.models import build_model, digest, mutate, spec_for_size
from lightning_wsync.testing.procs import receive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HEARTBEAT_TIMEOUT_S = 4.0
TIMEOUT_S = 5.0  # the dead sender's hop timeout: its keys linger TIMEOUT_S + HEARTBEAT_TIMEOUT_S
SLACK_S = 10.0  # membership refreshes and a loaded machine


def _relay_keys(server: dist.TCPStore, job: str, epoch: int) -> list[str]:
    prefix = f"wsync/{job}/relay/{epoch}/"
    return sorted(k for k in server.list_keys() if k.startswith(prefix))


def test_a_killed_senders_relay_keys_are_deleted_by_its_successor(children, monkeypatch, port) -> None:
    spec = spec_for_size(1)
    model = build_model(spec, seed=0)
    job = f"killed-{port}"
    ctl = _control(port, job)  # the store, hosted here
    server = ctl.raw
    assert isinstance(server, dist.TCPStore)
    store = f"127.0.0.1:{port}"
    first = children.start(sender_main, (store, job, spec, HEARTBEAT_TIMEOUT_S, TIMEOUT_S), name="wsync-test-s1")
    _, pid, dead, want = receive(first, 60, "the first sender's version 1")
    conns, rids = [], []
    for name in ("ka", "kb"):  # two hosts: a chain with a hop between leaders
        conn = children.start(receiver_main, (store, job, name, f"simhost-{name}", spec), name=f"wsync-test-{name}")
        rids.append(receive(conn, 60, f"host {name}'s receiver")[1])
        conns.append(conn)
    _wait("the chain a -> b", lambda: (c := read_chain(ctl, dead)) is not None and set(c.rids) == set(rids))
    _apply(conns, 1, want)
    left = _relay_keys(server, job, dead)
    assert any(k.endswith("/chain") for k in left), left
    os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]  # nothing of its own deleted
    with monkeypatch.context() as env:
        env.setenv("WSYNC_HOST_ID", "trainer-host")
        second = WeightSender(model, store=store, job=job, timeout_s=TIMEOUT_S, cross_host="relay",
                              heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)  # fmt: skip
    with second:
        started = time.monotonic()
        assert second.epoch == dead + 1
        mutate(model, 2)
        second.push(2)
        _apply(conns, 2, digest(model))  # every leader now follows the successor
        bound = TIMEOUT_S + HEARTBEAT_TIMEOUT_S + SLACK_S
        deadline = started + bound
        while (left := _relay_keys(server, job, dead)) and time.monotonic() < deadline:
            time.sleep(0.1)
        gone_s = time.monotonic() - started
        print(f"relay keys of the dead epoch {dead}: gone {gone_s:.1f} s after its successor started")
        assert left == [], (round(gone_s, 1), left)
        assert _relay_keys(server, job, second.epoch), "the successor's own relay keys were deleted"
        mutate(model, 3)
        second.push(3)
        _apply(conns, 3, digest(model))  # and the relay still carries versions after the sweep
    for conn in conns:
        conn.send(("await", 4))
        assert receive(conn, 30, "the close")[0] == "closed"
