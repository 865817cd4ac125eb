"""A receiver in its own process (started under unshare/setpriv by tests/planes/test_shm_fallback.py):
prints ``VERSION <v> <digest>`` for each version applied and the library's log lines."""

from __future__ import annotations

import logging
import sys

import torch
from _workers import build, digest

from lightning_wsync import WeightReceiver


def main(store: str, job: str, last: int) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    module = build(("mixed", 0))
    for t in module.state_dict().values():
        t.detach().zero_()
    with WeightReceiver(module, store=store, job=job, name="r0", timeout_s=10) as receiver:
        print("READY", flush=True)
        version = -1
        while version < last:
            version = receiver.wait_for_version(version + 1, timeout_s=60)
            print(f"VERSION {version} {digest(module)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
