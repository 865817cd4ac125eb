"""What the machine allows, measured on the pushed byte count with the benchmark's own code.

* ``memcpy``: one contiguous copy of S bytes, one thread (and two threads, for reference).
* ``gather``: the model's tensors copied into their places in one S-byte buffer (cast to
  the wire dtype), the way the sender's snapshot copies them: what any snapshot must do,
  so its gap to ``memcpy`` is per-tensor cost.
* ``shm``: the trainer writes S bytes into ``/dev/shm`` once, then N worker processes
  copy them into private buffers in parallel; timed until the last copy ends.
* ``shm_cast`` (only when the push casts, e.g. ``--dtype bfloat16``): the same, but the
  write is the model's tensors cast into the segment, as any cast snapshot must be
  (the cast reads the float32 bytes: more than a memcpy of the S cast bytes).
* ``tcp``: plain loopback TCP sockets, the trainer sending S bytes to each worker in
  turn into a private buffer; timed until the last worker has all of them.

Workers are separate spawned processes with one torch thread each. Timestamps cross
processes on ``time.monotonic()`` (CLOCK_MONOTONIC on Linux: one clock for the host).
Buffers live between :meth:`BoundBench.allocate` and :meth:`BoundBench.release`; one
:meth:`BoundBench.round` measures every bound once, so rounds can alternate with pushes
and a shared machine's load reaches both alike.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lightning_wsync.bench._boundworker import map_file, worker_main
from lightning_wsync.testing.probes import snapshot_copy
from lightning_wsync.testing.procs import BenchError, Children, receive

_SHM_DIR = "/dev/shm"


@dataclass
class BoundSamples:
    """Seconds per repetition of each bound (warm-ups excluded)."""

    memcpy_s: list[float] = field(default_factory=list)
    memcpy_2t_s: list[float] = field(default_factory=list)
    gather_s: list[float] = field(default_factory=list)
    shm_s: list[float] = field(default_factory=list)
    shm_write_s: list[float] = field(default_factory=list)
    shm_cast_s: list[float] = field(default_factory=list)
    tcp_s: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, list[float]]:
        return {k: list(v) for k, v in self.__dict__.items()}


class BoundBench:
    """N bound workers plus the trainer-side buffers; call :meth:`measure` any number of times."""

    def __init__(self, children: Children, n_workers: int, nbytes: int, timeout_s: float) -> None:
        self.nbytes = nbytes
        self.samples = BoundSamples()
        self._timeout_s = timeout_s
        self._path: str | None = None
        self._mm: mmap.mmap | None = None
        self._src: torch.Tensor | None = None
        self._dst: torch.Tensor | None = None
        self._shared: torch.Tensor | None = None
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._shared_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # the cast write, when casting
        self._socks: list[socket.socket] = []
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(n_workers)
        self._listener.settimeout(timeout_s)
        port = int(self._listener.getsockname()[1])
        self._conns = [
            children.start(worker_main, (i, port, timeout_s), name=f"wsync-bench-bound-{i}") for i in range(n_workers)
        ]
        socks: dict[int, socket.socket] = {}
        try:
            for _ in range(n_workers):
                sock, _addr = self._listener.accept()
                sock.settimeout(timeout_s)
                (index,) = struct.unpack("!I", _read(sock, 4))
                socks[index] = sock
            self._socks = [socks[i] for i in range(n_workers)]
            for i, conn in enumerate(self._conns):
                receive(conn, timeout_s, f"bound worker {i} to start")
        except BaseException:
            for sock in socks.values():
                sock.close()
            self._listener.close()
            raise

    def measure(self, reps: int, tensors: list[torch.Tensor], wire_dtype: torch.dtype | None) -> None:
        """Allocate, run one warm-up and ``reps`` timed rounds of every bound, release."""
        if reps <= 0:
            return
        self.allocate(tensors, wire_dtype)
        try:
            for _ in range(reps):
                self.round()
        except BaseException:
            self._free_local()  # workers may be mid-transfer: the caller closes without waiting
            raise
        self.release()

    def allocate(self, tensors: list[torch.Tensor], wire_dtype: torch.dtype | None) -> None:
        """Create every buffer (all pages resident) and run one untimed warm-up round."""
        self._path = os.path.join(_SHM_DIR, f"wsync-{os.getpid()}-bench-bound")
        self._src = torch.ones(self.nbytes, dtype=torch.uint8)
        self._dst = torch.zeros(self.nbytes, dtype=torch.uint8)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
        finally:
            os.close(fd)
        self._mm, self._shared = map_file(self._path, self.nbytes, writable=True)
        self._pairs = _gather_views(tensors, self._dst, wire_dtype)
        casts = wire_dtype is not None and any(t.is_floating_point() and t.dtype != wire_dtype for t in tensors)
        self._shared_pairs = _gather_views(tensors, self._shared, wire_dtype) if casts else []
        self._all("alloc", self.nbytes, self._path)
        self.round(keep=False)

    def round(self, keep: bool = True) -> None:
        """One repetition of every bound; appended to ``samples`` when ``keep``."""
        assert self._src is not None and self._dst is not None and self._shared is not None
        self._memcpy(self._src, self._dst, keep)
        self._gather(self._pairs, keep)
        self._shm(self._src, self._shared, keep)
        if self._shared_pairs:
            self._shm_cast(self._shared_pairs, keep)
        self._tcp(self._src, keep)

    def release(self) -> None:
        """Free every buffer (workers' too) and remove the shared segment."""
        try:
            self._all("free")
        finally:
            self._free_local()

    def _free_local(self) -> None:
        self._src = self._dst = self._shared = None
        self._pairs = self._shared_pairs = []
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a view is still referenced after a failure: the mapping dies with us
            self._mm = None
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = None

    def _all(self, *cmd: object) -> None:
        for conn in self._conns:
            conn.send(cmd)
        for i, conn in enumerate(self._conns):
            receive(conn, self._timeout_s, f"bound worker {i} to answer {cmd[0]!r}")

    def _memcpy(self, src: torch.Tensor, dst: torch.Tensor, keep: bool) -> None:
        t0 = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        torch.set_num_threads(2)
        try:
            dst.copy_(src)
        finally:
            torch.set_num_threads(1)
        t2 = time.perf_counter()
        if keep:
            self.samples.memcpy_s.append(t1 - t0)
            self.samples.memcpy_2t_s.append(t2 - t1)

    def _gather(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], keep: bool) -> None:
        t0 = time.perf_counter()
        _copy_pairs(pairs)
        if keep:
            self.samples.gather_s.append(time.perf_counter() - t0)

    def _shm(self, src: torch.Tensor, shared: torch.Tensor, keep: bool) -> None:
        total, write = self._shm_round(lambda: shared.copy_(src))
        if keep:
            self.samples.shm_s.append(total)
            self.samples.shm_write_s.append(write)

    def _shm_cast(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], keep: bool) -> None:
        total, _ = self._shm_round(lambda: _copy_pairs(pairs))
        if keep:
            self.samples.shm_cast_s.append(total)

    def _shm_round(self, write: Callable[[], object]) -> tuple[float, float]:
        """``write`` the shared segment, then every worker copies it out: (whole, write) seconds."""
        t0 = time.monotonic()
        write()
        t_write = time.monotonic()
        for conn in self._conns:
            conn.send(("shm",))
        done = [self._done(i, "a shared-memory copy") for i in range(len(self._conns))]
        return max(done) - t0, t_write - t0

    def _tcp(self, src: torch.Tensor, keep: bool) -> None:
        for conn in self._conns:
            conn.send(("tcp",))
        payload = src.numpy().data
        t0 = time.monotonic()
        for sock in self._socks:
            sock.sendall(payload)
        done = [self._done(i, "a socket transfer") for i in range(len(self._conns))]
        if keep:
            self.samples.tcp_s.append(max(done) - t0)

    def _done(self, i: int, what: str) -> float:
        msg = receive(self._conns[i], self._timeout_s, f"bound worker {i} to finish {what}")
        value = msg[1]
        if msg[0] != "done" or not isinstance(value, float):
            raise BenchError(f"bench: bound worker {i} answered {msg!r} to {what}")
        return value

    def close(self, *, graceful: bool = True) -> None:
        """Free buffers and let the workers go; the caller's :class:`Children` block reaps them.

        ``graceful=False`` (on a failure or a signal) waits on no worker: a worker may be
        stuck in a transfer that will never finish; closing the sockets wakes it.
        """
        try:
            if graceful and self._path is not None:
                self.release()
            if graceful:
                for conn in self._conns:
                    conn.send(("stop",))
        except (BenchError, OSError):
            pass  # a worker is gone: the Children block kills the rest
        finally:
            self._free_local()
            for sock in self._socks:
                sock.close()
            self._listener.close()


def _gather_views(
    tensors: list[torch.Tensor], dst: torch.Tensor, wire_dtype: torch.dtype | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination view in ``dst``, source tensor) pairs, back to back, cast to the wire dtype."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    offset = 0
    for t in tensors:
        dtype = wire_dtype if wire_dtype is not None and t.is_floating_point() else t.dtype
        nbytes = t.numel() * t.new_empty((), dtype=dtype).element_size()
        if offset + nbytes > dst.numel():
            break  # the real layout's alignment padding is not needed here
        pairs.append((dst[offset : offset + nbytes].view(dtype).view(t.shape), t.detach()))
        offset += nbytes
    return pairs


def _copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each source tensor into its view, the way the sender's snapshot copies (casting)."""
    snapshot_copy([view for view, _ in pairs], [t for _, t in pairs])


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise BenchError("bench: a bound worker closed its socket during the handshake")
        data += chunk
    return data
