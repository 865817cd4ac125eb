"""A bound worker process (see ``_bounds``): copies from the shared segment or receives
from its socket on the trainer's command, and reports when it is done."""

from __future__ import annotations

import mmap
import os
import socket
import struct
import time
import warnings
from multiprocessing.connection import Connection

import torch

from lightning_wsync.testing.procs import init_child, report_failure

_RECV_CHUNK = 1 << 22


def map_file(path: str, nbytes: int, *, writable: bool) -> tuple[mmap.mmap, torch.Tensor]:
    """``path``'s first ``nbytes`` bytes, shared, as a uint8 tensor (and the mapping that holds them)."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)
    if writable:
        return mm, torch.frombuffer(mm, dtype=torch.uint8)
    # torch warns on read-only buffers; a private read-only view is exactly what we want
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mm, torch.frombuffer(mm, dtype=torch.uint8)


def _recv_exact(sock: socket.socket, buffer: torch.Tensor) -> None:
    view = buffer.numpy().data
    got, total = 0, buffer.numel()
    while got < total:
        n = sock.recv_into(view[got:], min(_RECV_CHUNK, total - got))
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {total} bytes")
        got += n


def worker_main(conn: Connection, index: int, port: int, timeout_s: float) -> None:
    """A bound worker: copies from the shared segment or receives from its socket on command."""
    init_child()
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        sock.sendall(struct.pack("!I", index))
        private: torch.Tensor | None = None
        shared: torch.Tensor | None = None
        mm: mmap.mmap | None = None
        conn.send(("ready", os.getpid()))
        while True:
            cmd = conn.recv()
            op = cmd[0]
            if op == "alloc":
                nbytes, path = int(cmd[1]), str(cmd[2])
                private = torch.zeros(nbytes, dtype=torch.uint8)  # zeroed: every page resident
                mm, shared = map_file(path, nbytes, writable=False)
                conn.send(("ok",))
            elif op == "shm":
                assert private is not None and shared is not None
                private.copy_(shared)
                conn.send(("done", time.monotonic()))
            elif op == "tcp":
                assert private is not None
                _recv_exact(sock, private)
                conn.send(("done", time.monotonic()))
            elif op == "free":
                del shared
                shared = private = None
                if mm is not None:
                    mm.close()
                    mm = None
                conn.send(("ok",))
            elif op == "stop":
                sock.close()
                return
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        report_failure(conn, f"bound worker {index}")
