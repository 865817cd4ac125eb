"""Receivers of a sharded sender in one process, one per host id given (started under ``unshare`` by
tests/relay/test_relay_alone.py, in a /dev/shm of their own): prints ``READY``, then ``VERSION <name>
<v> <digest>`` for each version each applies, and the library's warnings (``LOG ...``)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

import torch
from _sharded import zeroed_sharded_model

from lightning_wsync import WeightReceiver, WeightSyncClosedError
from lightning_wsync.testing.models import digest


def main(store: str, job: str, last: int, hosts: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    lock = threading.Lock()

    def follow(receiver: WeightReceiver, module: torch.nn.Module) -> None:
        version = 0
        while version < last:
            try:
                version = receiver.wait_for_version(version + 1, timeout_s=120)
            except WeightSyncClosedError:
                return
            with lock:
                source = receiver._watcher.source  # test-only look inside: how the versions came
                how = "" if source is None else source.describe()
                print(f"VERSION {receiver.name} {version} {digest(module, None)} {how}", flush=True)

    with contextlib.ExitStack() as stack:
        threads = []
        for host in hosts:
            os.environ["WSYNC_HOST_ID"] = host  # read as each receiver starts
            module = zeroed_sharded_model()
            receiver = stack.enter_context(WeightReceiver(module, store=store, job=job, name=f"alone-{host}",
                                                          timeout_s=10, verify=True))  # fmt: skip
            threads.append(threading.Thread(target=follow, args=(receiver, module), name=f"follow-{host}"))
        print("READY", flush=True)
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
