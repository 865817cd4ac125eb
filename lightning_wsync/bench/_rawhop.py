"""Raw bounds of one cross-host hop for ``bench --hosts ... --transport``: the same bytes
moved from host 0 to host 1 by a bare gloo send, or by one bare NIXL READ, and the CPU
time every process of the bench's session spent on it (:func:`session_cpu_s`).

The bench runs as PID 1 of its own PID namespace with its own ``/proc``, so summing the
CPU time of every process listed there counts the trainer, the receivers and these
bound workers, user and kernel time (``utime + stime``, and the reaped children's).
Kernel work the network stack does in softirq context is charged to whichever process
it interrupted, or to ``ksoftirqd`` outside the session: the figures can undercount it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from lightning_wsync.testing.hosts import SimHosts, enter_netns
from lightning_wsync.testing.procs import BenchError, init_child, receive
from lightning_wsync.testing.stores import host_store

_CTX = mp.get_context("spawn")


def session_cpu_s() -> float:
    """CPU seconds (user + kernel, with reaped children) of every process in this PID namespace."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # ended meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / tick


def _gloo_group(store: dist.Store, rank: int, addr: str, timeout_s: float) -> Any:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # missing from stubs
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=addr)]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def _child(conn: Connection, netns: str, addr: str, transport: str, nbytes: int, store: str, timeout_s: float) -> None:
    init_child()
    enter_netns(netns)
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    if transport == "gloo":
        host, port = store.rsplit(":", 1)
        client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
        pg = _gloo_group(client, 1, addr, timeout_s)
        conn.send(("ready",))
        while conn.recv()[0] == "go":
            pg.recv([buffer], 0, 0).wait()
            conn.send(("done", time.monotonic(), int(buffer[-1])))
        return
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("raw-reader", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    agent.register_memory(buffer)
    conn.send(("ready", agent.get_agent_metadata()))
    metadata, address = conn.recv()[1:]
    loaded: object = agent.add_remote_agent(metadata)  # bytes, though typed str
    peer = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
    while conn.recv()[0] == "go":
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(buffer),
                                       agent.get_xfer_descs([(address, nbytes, 0)], "DRAM"), peer)  # fmt: skip
        state = agent.transfer(handle)
        while state == "PROC":
            time.sleep(0.0002)  # as the plane's reader polls: a busy poll would count a core for nothing
            state = agent.check_xfer_state(handle)
        handle.release()  # type: ignore[no-untyped-call,unused-ignore]  # untyped in nixl (absent: Any)
        conn.send(("done", time.monotonic(), int(buffer[-1])) if state == "DONE" else ("error", state))


def raw_hop(hosts: SimHosts, transport: str, nbytes: int, reps: int, timeout_s: float) -> dict[str, object]:
    """``reps`` moves of ``nbytes`` from host 0 (this process) to host 1: seconds and CPU per GB, medians."""
    source = torch.full((nbytes,), 7, dtype=torch.uint8)
    addr = hosts.address(0)
    server = pg = agent = None
    store = ""
    if transport == "gloo":
        server = host_store(addr, 0, timeout_s=timeout_s)
        store = f"{addr}:{server.port}"
    parent, child_end = _CTX.Pipe()
    child = _CTX.Process(target=_child, args=(child_end, hosts.netns_path(1), hosts.address(1), transport, nbytes,
                                              store, timeout_s), daemon=True)  # fmt: skip
    child.start()
    seconds: list[float] = []
    cpu: list[float] = []
    try:
        if transport == "gloo":
            assert server is not None
            pg = _gloo_group(server, 0, addr, timeout_s)
            receive(parent, timeout_s, "raw gloo receiver")
        else:
            from nixl_cu12._api import nixl_agent, nixl_agent_config

            agent = nixl_agent("raw-owner", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
            agent.register_memory(source)
            metadata = receive(parent, timeout_s, "raw NIXL reader")[1]
            assert isinstance(metadata, bytes)
            agent.add_remote_agent(metadata)
            parent.send(("meta", agent.get_agent_metadata(), source.data_ptr()))
        for rep in range(reps + 1):
            cpu0, t0 = session_cpu_s(), time.monotonic()
            parent.send(("go",))
            if pg is not None:
                pg.send([source], 1, 0).wait()
            while agent is not None and not parent.poll(0.0002):
                agent.get_new_notifs()  # the owner's side of UCX progresses only when polled (no progress thread)
            done = receive(parent, timeout_s, f"raw {transport} hop")
            if done[2] != 7:
                raise BenchError(f"raw {transport} hop: the bytes did not arrive")
            if rep:  # the first is a warm-up (connections, registrations)
                seconds.append(float(done[1]) - t0)  # type: ignore[arg-type]
                cpu.append(session_cpu_s() - cpu0)
        parent.send(("stop",))
    finally:
        child.join(timeout=timeout_s)
        if child.is_alive():
            child.kill()
        del pg, agent, server
    gb = nbytes / 1e9
    return {"transport": transport, "bytes": nbytes, "seconds": seconds, "cpu_s": cpu,
            "latency_s": statistics.median(seconds), "cpu_s_per_gb": statistics.median(cpu) / gb}  # fmt: skip
