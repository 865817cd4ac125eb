"""How long a gloo send already part-written waits when its peer closes its side (a script, not a
CI test; the evidence for ``wire.close_group``'s docstring, docs/reliability.md).

::

    nice -n 5 .venv/bin/python tests/relay/gloo_peer_close.py --iters 10

Two processes, a fresh two-rank group per iteration (``wire.make_group``, group timeout 8 s).
Rank 1 posts a receive of 256 MiB, lets 20 ms of it arrive and closes its side
(``close_group``: an interrupt, a probe receive that times out and closes the pair, abort).
Rank 0 only waits on its send. Prints, per iteration, the seconds rank 0's wait took and the
first line of its error.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

_SIZE = 256 << 20
_GROUP_TIMEOUT_S = 8.0


def _rank(rank: int, port: int, iters: int) -> None:
    import torch
    import torch.distributed as dist

    from lightning_wsync._planes.wire import Interruptible, close_group, make_group

    faulthandler.enable()
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=120))
    buf = torch.ones(_SIZE, dtype=torch.uint8)
    waits: list[tuple[float, str | None]] = []
    for i in range(iters):
        group = make_group("gloo", dist.PrefixStore(f"it{i}", store), rank, "127.0.0.1", _GROUP_TIMEOUT_S)
        pg = Interruptible(group, "gloo")
        store.set(f"ready{i}/{rank}", "1")
        store.wait([f"ready{i}/{1 - rank}"])
        if rank == 1:
            work = pg.recv([buf], 0, 0)
            time.sleep(0.02)  # part of the message arrives: the send is on the socket
            close_group(pg, 0, "gloo")
            try:
                work.wait()
            except RuntimeError:
                pass
            store.wait([f"next{i}"])
            continue
        started, error = time.monotonic(), None
        try:
            pg.send([buf], 1, 0).wait()
        except RuntimeError as exc:
            error = str(exc).splitlines()[0][:100]
        waits.append((round(time.monotonic() - started, 3), error))
        close_group(pg, 1, "gloo")
        store.set(f"next{i}", "1")
    if rank == 0:
        print(json.dumps({"group_timeout_s": _GROUP_TIMEOUT_S, "send_waits": waits}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int)
    args = ap.parse_args()
    if args.rank is not None:
        _rank(args.rank, args.port, args.iters)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--iters", str(args.iters), "--port", str(port),
                               "--rank", str(r)], env=env) for r in (0, 1)]  # fmt: skip
    print(json.dumps({"exit": [p.wait(timeout=60 + args.iters * 3 * _GROUP_TIMEOUT_S) for p in procs]}))


if __name__ == "__main__":
    main()
