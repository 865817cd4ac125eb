"""Try to crash a process at its exit while a gloo send it left behind still runs, or a receive, or
a store wait (a script, not a CI test; issue 32's exit -11, docs/reliability.md "the segfault at
exit").

::

    nice -n 5 .venv/bin/python tests/relay/stress_exit.py --case stuck --iters 300

The hypothesis: the interpreter finalizes (``sys.exit``, the end of main; not ``os._exit``) while
a gloo work left behind by the relay head (``hops.send_apart``: a send part-written into a peer
that stopped reading, woken by nothing but the group timeout) still runs on gloo's threads and on
a Python daemon thread blocked in ``work.wait()``; the wait ends during finalization, or the
process's static objects go while gloo's threads use them.

One peer process (spawned once: it hosts the ``TCPStore``) and, per iteration, a child that is
forked from this driver (torch and the library imported, no thread started: a fork costs
milliseconds where a spawn costs an import of torch) or spawned (``--spawn``). Each iteration:
the peer makes a two-rank gloo group with the child (``wire.make_group``, group timeout
``--group-timeout-s``) and posts a receive of 64 MiB; the child sends it from a thread through
the library's ``send_apart`` and leaves that thread behind (``Superseded``), as the relay head
does on a re-form; 0-3 ms into the send the child SIGSTOPs the peer (it stopped reading: the
send is part-written and stays so); then, per ``--case``:

``stuck``
    nothing more;
``aborted``
    the group is closed first (``close_group``: interrupt, probe receive, abort), as the feed's
    ``finally`` does;
``store_deleted``
    aborted, and the child's ``TCPStore`` client and prefix store are dropped and collected;
``shm_closed``
    the tensor sent is a slot of a library ``ShmSegment`` (``torch.frombuffer`` over its
    ``mmap``), closed and unlinked (``ShmSegment.close()``: drops references, never unmaps);
``mmap_closed``
    the tensor sent is a view of a plain ``mmap`` that is ``mmap.close()``d (unmapped under the
    send; what ``ShmSegment.close()`` never does).

``--side recv`` turns it round, as a tree leader's half thread (``leader/treehop.py``) left
behind on a re-form: the peer sends the 64 MiB and the child receives them on a thread of its
own, SIGSTOPping the peer 0-3 ms in (the receive part-read). ``--thread`` says how that thread is
made: ``library`` as the library does now (``send_apart``; for a receive ``exits.start``, the
half threads' start), registered with the wait at exit; ``plain``, a bare daemon
``threading.Thread`` left behind, as ``send_apart``'s before 7f42f82 and the half threads'
before the commit that added ``--side`` (nothing waits for it at exit).

``--side store`` leaves no gloo work behind but a daemon thread in a blocking store wait, as a
relay leader's bell waits (``Control.wait_for`` on a connection of its own, in a loop: a wait,
then the key deleted, as ``leader/bell.py``). The child picks a moment ``due`` 0 to 1 s after
its ``sys.exit`` plus a further 0 to 1.5 s (its finalization); per ``--case``, the peer sets
the awaited key then (``rung``) or the wait's own timeout falls then (``timed_out``). No group
is made. ``--thread`` does not apply.

The child then sleeps a random 0 to group timeout and exits with ``sys.exit(0)``: the group
timeout (where the left-behind wait returns) falls before its exit or inside its interpreter's
finalization (about 1 CPU-s for a process with torch loaded; the driver counts which). The
driver counts the child's exits by code and by signal, SIGCONTs the peer, and keeps the output of
every child that did not exit 0 cleanly. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import mmap
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

from stress_native import _first_line, _free_port  # this script's neighbour (tests/relay)

_SIZE = 64 << 20
_CASES = ["stuck", "aborted", "store_deleted", "shm_closed", "mmap_closed"]
_STORE_CASES = ["rung", "timed_out"]  # --side store: what ends the wait left behind
_FINALIZE_S = 1.5  # how far past sys.exit a store wait may end (finalizing takes ~1 CPU-s)
_CONNECT_S = 60.0  # the store's timeout (a child or the peer late under load)


def _store(port: int) -> None:
    """The store, hosted apart (as torchrun's agent does): the peer is SIGSTOPped under each send."""
    import torch.distributed as dist

    faulthandler.enable()
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=_CONNECT_S), wait_for_workers=False)
    store.set("store/up", "1")
    while True:
        time.sleep(3600)


def _peer(port: int, iters: int, group_timeout_s: float, side: str) -> int:
    """Rank 1 of every iteration's group: posts a receive (``side`` send) or a send (``side``
    recv), and moves bytes until it is SIGSTOPped."""
    import torch
    import torch.distributed as dist

    from lightning_wsync._planes.wire import Interruptible, close_group, make_group

    faulthandler.enable()
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=_CONNECT_S))
    store.set("peer/pid", str(os.getpid()))
    if side == "store":
        return _ringer(store, iters)
    buf = torch.empty(_SIZE, dtype=torch.uint8)
    errors: Counter[str] = Counter()
    for i in range(iters):
        try:
            store.wait([f"begin{i}"], timedelta(seconds=600))
        except RuntimeError:
            print(f"peer: no child {i} within 600 s", flush=True)
            return 3
        try:
            pg = Interruptible(make_group("gloo", dist.PrefixStore(f"it{i}", store), 1, "127.0.0.1",
                                          group_timeout_s), "gloo")  # fmt: skip
        except RuntimeError as exc:  # the child's connect failed (load): it exits with 5
            errors[f"connect: {_first_line(exc)}"] += 1
            store.set(f"posted{i}", "no group")
            continue
        work = pg.recv([buf], 0, 0) if side == "send" else pg.send([buf], 0, 0)
        store.set(f"posted{i}", "1")
        try:
            work.wait()  # ends when the child's end resets the pair, or at the group timeout
        except RuntimeError as exc:
            errors[_first_line(exc)] += 1
        close_group(pg, 0, "gloo")
        del work, pg
        gc.collect()
    print(json.dumps({"peer_errors": errors}), flush=True)
    return 0


def _ringer(store: object, iters: int) -> int:
    """The peer of ``--side store``: sets each child's awaited key at the moment it asked for."""
    from lightning_wsync._control.store import Control

    ctl = Control(store, "stress")  # type: ignore[arg-type]
    for i in range(iters):
        if not ctl.wait_for(f"begin{i}", 600.0):
            print(f"peer: no child {i} within 600 s", flush=True)
            return 3
        due = ctl.get_text(f"due{i}")
        if due is None or due == "none":
            continue
        time.sleep(max(0.0, float(due) - time.monotonic()))  # CLOCK_MONOTONIC: one clock for every process
        ctl.set_text(f"bell{i}", "1")
    print(json.dumps({"peer_errors": {}}), flush=True)
    return 0


def _store_child(i: int, port: int, case: str, seed: int, times: Path) -> None:
    """``--side store``: leave a daemon thread in a blocking store wait that ends (rung, or at
    its own timeout) 0 to 1.5 s after ``sys.exit``, then exit through finalization."""
    started = time.monotonic()
    import torch.distributed as dist

    from lightning_wsync._control.store import Control

    faulthandler.enable()
    faulthandler.dump_traceback_later(60)
    rng = random.Random(seed * 100_003 + i)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=_CONNECT_S))
    ctl = Control(store, "stress")
    waiter = ctl.clone()  # its waits block this connection, as the bell's
    sleep_s = rng.uniform(0, 1.0)
    due = time.monotonic() + sleep_s + rng.uniform(0, _FINALIZE_S)
    key = f"bell{i}"

    def bell() -> None:  # as leader/bell.py's thread: wait, delete, read, wait again
        while True:
            left = due - time.monotonic() if case == "timed_out" else 60.0
            if waiter.wait_for(key, max(0.001, left)):
                waiter.delete(key)
            waiter.get_text(f"due{i}")  # the bell's reads after a wake-up

    ctl.set_text(f"due{i}", repr(due) if case == "rung" else "none")
    threading.Thread(target=bell, name=f"wsync-relay-bell-it{i}", daemon=True).start()
    ctl.set_text(f"begin{i}", "1")
    joined_at = time.monotonic()
    time.sleep(sleep_s)
    times.write_text(json.dumps({"started": started, "joined_at": joined_at, "due": due,
                                 "exit_at": time.monotonic()}))  # fmt: skip
    sys.exit(0)


def _child(
    i: int, port: int, case: str, group_timeout_s: float, seed: int, times: Path, side: str = "send",
    how: str = "library",
) -> None:  # fmt: skip
    """Rank 0 of iteration ``i``: leave a send (or a receive) behind, then exit through interpreter finalization."""
    if side == "store":
        _store_child(i, port, case, seed, times)
    started = time.monotonic()
    import torch
    import torch.distributed as dist

    from lightning_wsync._planes.relay import exits
    from lightning_wsync._planes.relay.hops import Superseded, send_apart
    from lightning_wsync._planes.shm.segment import ShmSegment
    from lightning_wsync._planes.wire import Interruptible, close_group, make_group

    faulthandler.enable()
    faulthandler.dump_traceback_later(60)  # a child stuck 60 s shows where (the driver kills it at 120 s)
    rng = random.Random(seed * 100_003 + i)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=_CONNECT_S))
    peer_pid = int(store.get("peer/pid"))
    store.set(f"begin{i}", "1")
    prefix = dist.PrefixStore(f"it{i}", store)
    try:
        pg = Interruptible(make_group("gloo", prefix, 0, "127.0.0.1", group_timeout_s), "gloo")
    except RuntimeError as exc:
        print(f"child {i}: no group: {_first_line(exc)}", flush=True)
        sys.exit(5)
    if store.get(f"posted{i}") != b"1":
        sys.exit(5)
    joined_at = time.monotonic()
    segment: ShmSegment | None = None
    mm: mmap.mmap | None = None
    path = f"/dev/shm/wsync-stress-exit-{os.getpid()}"
    if case == "shm_closed":
        segment = ShmSegment(f"wsync-{os.getpid()}-{i}-stress_exit", _SIZE, create=True, slots=1)
        tensor = segment.data[0]
    elif case == "mmap_closed":
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, _SIZE)
        mm = mmap.mmap(fd, _SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        tensor = torch.frombuffer(mm, dtype=torch.uint8)
    else:
        tensor = torch.empty(_SIZE, dtype=torch.uint8)
    tensor[::4096] = i % 251
    left = threading.Event()

    def send(tensor: torch.Tensor = tensor) -> None:  # holds it while the send runs, as a lease does
        pg.send([tensor], 1, 0).wait()

    def receive(tensor: torch.Tensor = tensor) -> None:  # as a half thread receives into the target
        try:
            pg.recv([tensor], 1, 0).wait()
        except RuntimeError as exc:
            print(f"child {i}: the receive left behind ended: {_first_line(exc)}", flush=True)

    def superseded() -> bool:
        if not left.is_set():
            time.sleep(rng.uniform(0, 0.003))  # part of the 64 MiB is on the wire
            os.kill(peer_pid, signal.SIGSTOP)  # the peer stops (the driver SIGCONTs it)
            left.set()
        return True

    sent_at = time.monotonic()
    if side == "recv":
        name = f"wsync-relay-tree0-it{i}"
        if how == "library":
            exits.start(receive, name, group_timeout_s)  # as TreeHop.receive_both starts its halves
        else:
            threading.Thread(target=receive, name=name, daemon=True).start()
        superseded()  # the receive is left behind, part-read, as on a re-form
    elif how == "library":
        try:
            send_apart(send, lambda: None, superseded, f"wsync-relay-head-send-it{i}", group_timeout_s)
        except Superseded:
            pass  # the send is left behind, on its own thread, as on a re-form
        except RuntimeError as exc:
            print(f"child {i}: the send ended at once: {_first_line(exc)}", flush=True)
    else:
        threading.Thread(target=send, name=f"wsync-relay-head-send-it{i}", daemon=True).start()
        superseded()
    if case != "stuck":
        close_group(pg, 1, "gloo")
    if case == "store_deleted":
        del prefix, store
        gc.collect()
    if segment is not None:
        segment.close()
    del tensor
    if mm is not None:
        mm.close()  # unmaps under the send
        os.unlink(path)
    gc.collect()
    time.sleep(rng.uniform(0, group_timeout_s))  # finalizing takes 1 CPU-s here: the timeout lands in it or before
    times.write_text(json.dumps({"started": started, "joined_at": joined_at, "sent_at": sent_at,
                                 "exit_at": time.monotonic()}))  # fmt: skip
    sys.exit(0)  # through Py_FinalizeEx, atexit and the static destructors


def _driver(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")  # no thread at import (numpy's OpenBLAS)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    me = [sys.executable, __file__, "--case", args.case, "--group-timeout-s", str(args.group_timeout_s),
          "--seed", str(args.seed), "--port", str(port), "--iters", str(args.iters), "--side", args.side,
          "--thread", args.thread]  # fmt: skip
    peer_log = open(out / "peer.log", "w")  # noqa: SIM115 - the peer's and the store's, for the whole run
    store = subprocess.Popen([*me, "--store"], env=env, stdout=peer_log, stderr=subprocess.STDOUT)
    peer = subprocess.Popen([*me, "--peer"], env=env, stdout=peer_log, stderr=subprocess.STDOUT)
    if not args.spawn:
        import torch  # noqa: F401 - imported once here, inherited by each forked child

        import lightning_wsync._control.store  # noqa: F401
        import lightning_wsync._planes.relay.exits  # noqa: F401
        import lightning_wsync._planes.relay.hops  # noqa: F401
        import lightning_wsync._planes.shm.segment  # noqa: F401
        import lightning_wsync._planes.wire  # noqa: F401

        tasks = len(os.listdir("/proc/self/task"))
        assert tasks == 1, f"the driver runs {tasks} threads: forking it would not be a clean child"
    exits: Counter[str] = Counter()
    windows: Counter[str] = Counter()  # where the group timeout fell: before exit, during finalization, after
    start = time.monotonic()
    for i in range(args.iters):
        log_path = out / f"child{i}.log"
        times = out / f"child{i}.times"
        t0 = time.monotonic()
        if args.spawn:
            with open(log_path, "w") as log:
                proc = subprocess.Popen([*me, "--child", str(i), "--times", str(times)], env=env, stdout=log,
                                        stderr=subprocess.STDOUT)  # fmt: skip
                status = proc.wait(timeout=300)
        else:
            pid = os.fork()
            if pid == 0:
                fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                _child(i, port, args.case, args.group_timeout_s, args.seed, times, args.side, args.thread)
                sys.exit(0)
            status = _wait_child(pid, peer.pid, 120.0)
        ended = time.monotonic()
        os.kill(peer.pid, signal.SIGCONT)
        text = log_path.read_text(errors="replace")
        bad = status != 0 or "terminate called" in text or "Fatal Python" in text
        label = f"signal {-status}" if status < 0 else f"exit {status}"
        if status == 0 and bad:
            label = "exit 0 with a crash report"
        exits[label] += 1
        window = "no times"
        if times.exists():
            t = json.loads(times.read_text())
            due = t["due"] if "due" in t else t["sent_at"] + args.group_timeout_s
            window = "before exit" if due < t["exit_at"] else "in finalization" if due <= ended else "after end"
            windows[window] += 1
            if os.environ.get("STRESS_VERBOSE"):
                print(
                    f"it {i}: fork {t['started'] - t0:.2f} group {t['joined_at'] - t['started']:.2f} "
                    f"left {t['exit_at'] - t['sent_at']:.2f} finalize {ended - t['exit_at']:.2f}",
                    flush=True,
                )
            times.unlink()
        with open(out / "iterations.jsonl", "a") as f:  # what a run cut short still counts
            f.write(json.dumps({"i": i, "exit": label, "timeout_fell": window}) + "\n")
        if bad:
            print(f"iteration {i}: {label} (timeout {window}) after {ended - t0:.2f} s; log {log_path}", flush=True)
        else:
            log_path.unlink()
        if peer.poll() is not None:
            if i < args.iters - 1:  # a peer of --side store ends after the last child's moment
                print(f"the peer ended ({peer.returncode}) at iteration {i}", flush=True)
            break
    if peer.poll() is None:
        os.kill(peer.pid, signal.SIGCONT)
    try:
        peer.wait(timeout=60)
    except subprocess.TimeoutExpired:
        peer.kill()
        peer.wait()
    store.kill()
    store.wait()
    print(json.dumps({"case": args.case, "side": args.side, "thread": args.thread, "spawn": args.spawn,
                      "iters": args.iters, "seed": args.seed,
                      "group_timeout_s": args.group_timeout_s, "wall_s": round(time.monotonic() - start, 1),
                      "exits": exits, "timeout_fell": windows, "peer": peer.returncode}), flush=True)  # fmt: skip


def _wait_child(pid: int, peer_pid: int, bound_s: float) -> int:
    """The child's exit code, or minus its signal; a child still there after ``bound_s`` is
    SIGKILLed and counted as -SIGKILL (a hang, not a crash: its log says where, faulthandler)."""
    deadline = time.monotonic() + bound_s
    while True:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
        if time.monotonic() > deadline:
            os.kill(peer_pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.005)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="stuck", choices=_CASES + _STORE_CASES)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--group-timeout-s", type=float, default=1.0)
    ap.add_argument("--side", default="send", choices=["send", "recv", "store"],
                    help="what the child leaves behind: a gloo send, a gloo receive, a blocking store wait")
    ap.add_argument("--thread", default="library", choices=["library", "plain"],
                    help="library: registered with the wait at exit, as now; plain: a bare daemon thread")
    ap.add_argument("--spawn", action="store_true", help="a fresh interpreter per child (slower: imports torch)")
    ap.add_argument("--out", default="/tmp/stress_exit")
    ap.add_argument("--port", type=int)
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--store", action="store_true")
    ap.add_argument("--child", type=int)
    ap.add_argument("--times")
    args = ap.parse_args()
    if (args.side == "store") != (args.case in _STORE_CASES):
        ap.error(f"--case {args.case!r} does not go with --side {args.side!r}; --side store takes {_STORE_CASES}")
    if args.store:
        _store(args.port)
    if args.peer:
        sys.exit(_peer(args.port, args.iters, args.group_timeout_s, args.side))
    if args.child is not None:
        _child(args.child, args.port, args.case, args.group_timeout_s, args.seed, Path(args.times), args.side,
               args.thread)  # fmt: skip
        return  # the end of main
    _driver(args)


if __name__ == "__main__":
    main()
