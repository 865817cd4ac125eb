"""A simulated host's receivers in one child process, applying the versions its parent names.

Used by ``lightning-wsync bench --store-load`` and the relay's store-load test: the child
joins the job under the host identity it is given (``WSYNC_HOST_ID``), so its receivers take
the cross-host path on loopback.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import NamedTuple

from lightning_wsync import WeightReceiver, WeightSyncClosedError
from lightning_wsync.testing.hosts import assume_host
from lightning_wsync.testing.models import ModelSpec, build_model, digest
from lightning_wsync.testing.procs import init_child, report_failure


class HostArgs(NamedTuple):
    store: str
    job: str
    names: list[str]
    host_id: str | None  # None: the trainer's host
    spec: ModelSpec
    timeout_s: float


def host_main(conn: Connection, args: HostArgs) -> None:
    """Receivers of one host in one process: apply each version the parent names, send digests."""
    init_child()
    if args.host_id is not None:
        assume_host(args.host_id)
    receivers: list[WeightReceiver] = []
    try:
        models = [build_model(args.spec, seed=None) for _ in args.names]
        receivers = [WeightReceiver(m, store=args.store, job=args.job, name=n, timeout_s=args.timeout_s)
                     for m, n in zip(models, args.names)]  # fmt: skip
        conn.send(("ready", os.getpid()))
        while conn.poll(args.timeout_s * 4):
            msg = conn.recv()
            if msg[0] != "await":
                break
            for receiver in receivers:
                receiver.wait_for_version(msg[1], timeout_s=args.timeout_s)
            conn.send(("applied", msg[1], [digest(m) for m in models]))
    except WeightSyncClosedError:
        pass
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        report_failure(conn, f"receivers {args.names}")
    finally:
        for receiver in receivers:
            receiver.close()
    conn.send(("closed",))
