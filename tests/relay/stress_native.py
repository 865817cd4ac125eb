"""Try to crash the native code the tree head's trainer runs while a tree re-forms (a script, not a
CI test; issue 32's exit -11, docs/reliability.md "the segfault, by reproducer").

::

    nice -n 5 .venv/bin/python tests/relay/stress_native.py --scenario drop_under_send --iters 300

Two processes (this script, re-run as rank 0 and rank 1, ``PYTHONFAULTHANDLER=1``) keep one
``TCPStore`` and make a fresh two-rank gloo group per iteration (``wire.make_group``, as a hop
does). Rank 0's sends and receives use views of a ``/dev/shm`` mapping (``torch.frombuffer``
over an ``mmap``, as the snapshot ring's slots are). Per iteration, after a random 0-3 ms:

``drop_under_send``
    a thread sends 16 MiB from the mapping (``Interruptible``, as ``send_apart``'s thread does);
    rank 1 posts its receive and closes its side mid-transfer (``close_group``: the pair is
    reset, as for a SIGKILLed leader). Meanwhile rank 0's main thread runs the feed's
    ``finally``: ``close_group`` (interrupt, probe receive, abort), drops its reference to the
    group and ``gc.collect()``, then drops its views and the ``mmap`` object (as
    ``ShmSegment.close()``), unlinks the file, and only then waits for the send thread.
``drop_under_recv``
    the same, with rank 0's thread receiving 16 MiB into the mapping while rank 1 sends and
    closes mid-way.
``group_freed_under_send``
    as ``drop_under_send``, but the thread holds only the send's work, not the group: the
    last reference to the ``ProcessGroupGloo`` goes (``close_group`` first) while the work is
    waited on (our code never does this: a send's thread holds its ``Interruptible``).
``unmapped_under_send`` (the positive control: the pattern ``ShmSegment.close()`` avoids)
    as ``drop_under_send``, but the ``mmap`` is closed explicitly (``mmap.close()`` unmaps
    even while ``torch.frombuffer`` views exist) before the groups are closed, while the send
    may be reading it. gloo's tcp pair writes from the buffer with a system call, which fails
    with ``EFAULT`` on an unmapped page instead of faulting.
``unmapped_under_hash`` (the positive control: this harness sees a crash when there is one)
    a thread hashes the view with xxhash (as the tree head's hasher thread reads a ring slot)
    while the ``mmap`` is closed: a read in user space of an unmapped page is a SIGSEGV.

Rank 0 exits with the iterations done; a signal shows as a negative exit and a faulthandler
dump in the output. Prints one JSON line: scenario, iterations, wall, both exit codes.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import mmap
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta

_SIZE = 16 << 20
_SCENARIOS = [
    "drop_under_send",
    "drop_under_recv",
    "group_freed_under_send",
    "unmapped_under_send",
    "unmapped_under_hash",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][-120:] if str(exc).strip() else type(exc).__name__


def _rank(rank: int, port: int, scenario: str, iters: int, seed: int) -> int:
    import torch
    import torch.distributed as dist
    import xxhash

    from lightning_wsync._planes.wire import Interruptible, close_group, make_group

    faulthandler.enable()
    rng = random.Random(seed * 2 + rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    path = f"/dev/shm/wsync-stress-{os.getpid()}"
    errors: Counter[str] = Counter()  # the thread's work errors, by first line
    loop_start = time.monotonic()
    for i in range(iters):
        faulthandler.dump_traceback_later(30)  # an iteration stuck 30 s shows where (a hang is not a crash)
        t0 = time.monotonic()
        pg = Interruptible(make_group("gloo", dist.PrefixStore(f"it{i}", store), rank, "127.0.0.1", 5.0), "gloo")
        store.set(f"ready{i}/{rank}", "1")
        store.wait([f"ready{i}/{1 - rank}"])
        t_made = time.monotonic()
        if rank == 1:
            buf = torch.empty(_SIZE, dtype=torch.uint8)
            recv = scenario != "drop_under_recv"
            try:
                work = pg.recv([buf], 0, 0) if recv else pg.send([buf], 0, 0)
            except RuntimeError as exc:  # rank 0 closed first
                errors[_first_line(exc)] += 1
                continue
            time.sleep(rng.uniform(0, 0.003))
            close_group(pg, 0, "gloo")  # the pair reset mid-transfer
            try:
                work.wait()
            except RuntimeError:
                pass
            del work, pg
            gc.collect()
            continue
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, _SIZE)
        mm = mmap.mmap(fd, _SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        whole = torch.frombuffer(mm, dtype=torch.uint8)
        view = whole[:_SIZE]
        view[::4096] = i % 251

        if scenario == "group_freed_under_send":
            try:
                posted: object = pg._pg.send([view], 1, 0)  # the thread holds the work alone, not the group
            except RuntimeError as exc:  # the peer closed first
                errors[_first_line(exc)] += 1
                posted = None

            def io(work: object = posted) -> None:
                try:
                    if work is not None:
                        work.wait()  # type: ignore[attr-defined]
                except RuntimeError as exc:
                    errors[_first_line(exc)] += 1

            del posted
        elif scenario == "unmapped_under_hash":

            def io(view: torch.Tensor = view) -> None:
                h = xxhash.xxh3_64()
                for a in range(0, _SIZE, 1 << 16):
                    h.update(view[a : a + (1 << 16)].numpy().data)  # as the ring's checksums read a slot
        else:

            def io(pg: Interruptible = pg, view: torch.Tensor = view) -> None:
                try:
                    if scenario == "drop_under_recv":
                        pg.recv([view], 1, 0).wait()
                    else:
                        pg.send([view], 1, 0).wait()
                except RuntimeError as exc:
                    errors[_first_line(exc)] += 1

        thread = threading.Thread(target=io, daemon=True)
        thread.start()
        time.sleep(rng.uniform(0, 0.003))
        if scenario.startswith("unmapped_"):
            mm.close()  # unmaps although views exist, the send under way: what ShmSegment.close() never does
        close_group(pg, 1, "gloo")  # the feed's finally, while the thread's work is in flight
        del pg, io, view
        gc.collect()
        del whole, mm
        gc.collect()
        os.unlink(path)
        t_join = time.monotonic()
        thread.join(10)
        if os.environ.get("STRESS_VERBOSE"):
            print(f"it {i}: make {t_made - t0:.3f}s join {time.monotonic() - t_join:.3f}s", flush=True)
        if thread.is_alive():
            print(f"iteration {i}: the thread is still running after 10 s", flush=True)
            return 3
    loop_s = round(time.monotonic() - loop_start, 2)
    print(json.dumps({"rank": rank, "iterations_done": iters, "loop_s": loop_s, "errors": errors}), flush=True)
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="drop_under_send", choices=_SCENARIOS)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int)
    args = ap.parse_args()
    if args.rank is not None:
        sys.exit(_rank(args.rank, args.port, args.scenario, args.iters, args.seed))
    port = _free_port()
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    base = [sys.executable, __file__, "--scenario", args.scenario, "--iters", str(args.iters),
            "--seed", str(args.seed), "--port", str(port), "--rank"]  # fmt: skip
    start = time.monotonic()
    procs = [subprocess.Popen([*base, str(r)], env=env) for r in (0, 1)]
    codes: list[int | None] = [None, None]
    try:
        codes[0] = procs[0].wait(timeout=max(120, args.iters * 2))
    except subprocess.TimeoutExpired:
        procs[0].kill()
        codes[0] = procs[0].wait()
    try:
        codes[1] = procs[1].wait(timeout=15)
    except subprocess.TimeoutExpired:
        procs[1].kill()
        codes[1] = procs[1].wait()
    print(json.dumps({"scenario": args.scenario, "iters": args.iters, "seed": args.seed,
                      "wall_s": round(time.monotonic() - start, 1), "exit": codes}))  # fmt: skip


if __name__ == "__main__":
    main()
