"""A receiver on a relay host (``WSYNC_HOST_ID`` names the host), started by tests/relay/test_relay_setup.py,
possibly under ``unshare``: appends ``ready`` and ``applied`` events (JSON lines) to a file; prints the
relay's log lines."""

from __future__ import annotations

import logging
import os
import sys

import torch
from _relay_receiver import emit  # tests/multihost
from _workers import build, digest

from lightning_wsync import WeightReceiver
from lightning_wsync._control.host import pid_namespace


def main(store: str, job: str, name: str, events: str, last: int, spec: tuple[str, int] = ("mixed", 0)) -> None:
    emit(events, event="imported", name=name)  # Python, torch and the library loaded: start-up is the machine's
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(levelname)s %(name)s: %(message)s")
    logging.getLogger("lightning_wsync._planes.relay").setLevel(logging.INFO)
    torch.set_num_threads(1)
    module = build(spec)
    for t in module.state_dict().values():
        t.detach().zero_()
    with WeightReceiver(module, store=store, job=job, name=name, timeout_s=10) as receiver:
        emit(events, event="ready", name=name, rid=receiver.rid, pid=os.getpid(), pidns=pid_namespace())
        version = -1
        while version < last:
            version = receiver.wait_for_version(version + 1, timeout_s=120)
            emit(events, event="applied", name=name, version=version, digest=digest(module))


if __name__ == "__main__":
    kind, arg = (sys.argv[6] if len(sys.argv) > 6 else "mixed,0").split(",")  # the model: _workers.build's spec
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), (kind, int(arg)))
