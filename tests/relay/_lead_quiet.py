"""Child processes for tests/relay/test_relay_lead_quiet.py: a sender that the test can SIGKILL,
and a relay host's receiver that reports when it applied a version or saw the sender close."""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection

from lightning_wsync import WeightReceiver, WeightSender, WeightSyncClosedError
from lightning_wsync.testing.hosts import assume_host
from lightning_wsync.testing.models import ModelSpec, build_model, digest, mutate
from lightning_wsync.testing.procs import init_child, report_failure


def sender_main(
    conn: Connection, store: str, job: str, spec: ModelSpec, heartbeat_timeout_s: float, timeout_s: float = 20
) -> None:
    """Push version 1 on the trainer's host, report its digest, then wait to be killed."""
    init_child()
    assume_host("trainer-host")
    try:
        model = build_model(spec, seed=0)
        sender = WeightSender(model, store=store, job=job, timeout_s=timeout_s, cross_host="relay",
                              heartbeat_timeout_s=heartbeat_timeout_s)  # fmt: skip
        mutate(model, 1)
        sender.push(1).wait(20)
        conn.send(("pushed", os.getpid(), sender.epoch, digest(model)))
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        report_failure(conn, "sender")
        return
    conn.recv()  # until the test SIGKILLs this process (no close: the store keeps no close record)


def receiver_main(conn: Connection, store: str, job: str, name: str, host: str, spec: ModelSpec) -> None:
    """One receiver on relay host ``host``: ("await", v) -> ("applied", v, digest, time.time()); when
    the sender closes, ("closed", time.time()) and the receiver is closed."""
    init_child()
    assume_host(host)
    try:
        model = build_model(spec, seed=None)
        with WeightReceiver(model, store=store, job=job, name=name, timeout_s=20) as receiver:
            conn.send(("ready", receiver.rid))
            while conn.poll(120):
                msg = conn.recv()
                try:
                    version = receiver.wait_for_version(msg[1], timeout_s=60)
                except WeightSyncClosedError:
                    conn.send(("closed", time.time()))
                    return
                conn.send(("applied", version, digest(model), time.time()))
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        report_failure(conn, f"receiver {name}")
