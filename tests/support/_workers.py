"""Models and child-process entry points shared by the multi-process tests."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback
from typing import Any

import torch
from torch import nn

from lightning_wsync.testing.models import digest, mutate  # noqa: F401 - the package's own, shared with the bench


def mixed_model(seed: int = 0) -> nn.Module:
    """fp32 and bf16 parameters plus an int64 buffer."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16).to(torch.bfloat16), nn.LayerNorm(16))
    m.register_buffer("steps", torch.arange(5, dtype=torch.int64) * (seed + 1))
    return m


def big_model(mb: int, seed: int = 0) -> nn.Module:
    """About ``mb`` MiB of fp32 in a few large matrices."""
    torch.manual_seed(seed)
    side = 1024
    n = max(1, mb // 4)  # each 1024x1024 fp32 matrix is 4 MiB
    m = nn.ParameterList([nn.Parameter(torch.empty(side, side).uniform_(-1, 1)) for _ in range(n)])
    return m


def build(spec: tuple[str, int]) -> nn.Module:
    kind, arg = spec
    if kind == "mixed":
        return mixed_model(arg)
    if kind == "big":
        return big_model(arg, seed=1)
    if kind in ("cuda0", "cuda1"):  # the GPU tests' model, on the first or second GPU
        torch.manual_seed(arg)
        m = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 64).to(torch.bfloat16))
        m.register_buffer("steps", torch.arange(4))
        return m.to(f"cuda:{kind[-1]}")
    if kind == "big-cuda0":  # ``arg`` MiB of fp32 on the first GPU
        return big_model(arg, seed=1).to("cuda:0")
    raise ValueError(spec)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def receiver_main(
    store: str, job: str, name: str, spec: tuple[str, int], results: mp.Queue[Any], options: dict[str, Any]
) -> None:
    """Follow the job: report (name, version, digest, pid) after each version applied."""
    torch.set_num_threads(1)
    from lightning_wsync import WeightReceiver, WeightSyncClosedError, WeightSyncError

    module = build(spec)
    for t in module.state_dict().values():
        t.detach().zero_()
    try:
        with WeightReceiver(module, store=store, job=job, name=name, **options) as receiver:
            results.put(("ready", name, os.getpid()))
            want = 0
            while True:
                try:
                    version = receiver.wait_for_version(want, timeout_s=120)
                except WeightSyncClosedError:
                    results.put(("closed", name, receiver.version))
                    return
                source = receiver._watcher.source  # which plane served it (tests of plane choice)
                plane = "" if source is None else source.describe()
                results.put(("version", name, version, digest(module), _rss_kib(), plane))
                want = version + 1
    except WeightSyncError as exc:
        results.put(("error", name, type(exc).__name__, str(exc)))


class Inbox:
    """One queue per child: a child killed or stopped while writing (holding its queue's
    lock) cannot block the others' reports."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self.queues: dict[str, Any] = {}

    def queue(self, name: str) -> Any:
        self.queues[name] = self._ctx.Queue()
        return self.queues[name]


def collect(inbox: Inbox, kind: str, names: set[str], timeout_s: float) -> dict[str, tuple[Any, ...]]:
    """Read messages until one of ``kind`` arrived from each of ``names``."""
    import time

    got: dict[str, tuple[Any, ...]] = {}
    deadline = time.monotonic() + timeout_s
    while set(got) < names:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {kind!r} from {sorted(names - set(got))}; got {got}")
        for name in sorted(names - set(got)):
            try:
                msg = inbox.queues[name].get(timeout=0.02)
            except queue.Empty:
                continue
            if msg[0] == "error":
                raise AssertionError(f"receiver failed: {msg}")
            if msg[0] == kind:
                got[name] = msg
    return got


def writer_main(store: str, job: str, producer: int, count: int) -> None:
    """Put ``count`` items whose contents encode (producer, index)."""
    from lightning_wsync.channel import ExperienceWriter

    writer = ExperienceWriter(store=store, job=job, capacity=4, timeout_s=60)
    for i in range(count):
        tensors = {"who": torch.tensor([producer, i]), "x": torch.full((3,), float(i), dtype=torch.bfloat16)}
        writer.put(tensors, version=i)


def corrupting_receiver_main(
    store: str, job: str, name: str, spec: tuple[str, int], results: Any, options: dict[str, Any], bad_version: int
) -> None:
    """A receiver whose network link flips one byte of ``bad_version`` after it arrives."""
    import lightning_wsync._planes.net.link as net

    real_make_group = net.make_group

    class Corrupting:
        def __init__(self, pg: Any) -> None:
            self.pg = pg
            self.version = -1
            self.armed = False

        def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
            work = self.pg.recv(tensors, src, tag)
            tensor, outer = tensors[0], self

            class Work:
                def wait(self) -> bool:
                    ok = bool(work.wait())
                    if tensor.dtype == torch.int64 and tensor.numel() == 5:  # header
                        outer.version = int(tensor[0])
                        outer.armed = outer.version == bad_version
                    elif tensor.dtype == torch.uint8 and tensor.numel() > 64 and outer.armed:  # bucket or delta record
                        tensor.view(-1)[tensor.numel() // 2] ^= 0x40
                        outer.armed = False
                    return ok

            return Work()

        def send(self, *args: Any) -> Any:
            return self.pg.send(*args)

        def abort(self) -> None:
            self.pg.abort()

    net.make_group = lambda *a, **k: Corrupting(real_make_group(*a, **k))  # type: ignore[assignment]
    receiver_main(store, job, name, spec, results, options)


def sparse_change(module: nn.Module, version: int, every: int = 97) -> None:
    """Change one element in ``every`` of each floating tensor (a different set per version)."""
    with torch.no_grad():
        for t in module.state_dict().values():
            if t.is_floating_point():
                flat = t.view(-1)
                flat[version % every :: every] += 0.01 * version


def sender_main(port: int, job: str, spec: tuple[str, int], results: Any) -> None:
    """Host the store, push version 1, report its digest, then idle until killed."""
    import threading

    from lightning_wsync import WeightSender

    model = build(spec)
    mutate(model, 1)
    sender = WeightSender(model, store=f"127.0.0.1:{port}", job=job, timeout_s=10)
    sender.push(1)
    results.put(("pushed", "sender", 1, digest(model)))
    threading.Event().wait()


def corrupt_newest_slot(sender: Any, job: str, version: int, deadline: float) -> None:
    """Once ``version``'s checksums are published, flip a bit of it in the sender's shared ring."""
    while not sender.store.check([f"wsync/{job}/v/{version}/sums"]):  # bounded poll: sums published
        assert time.monotonic() < deadline, f"checksums of version {version} never published"
        time.sleep(0.005)
    newest = sender._ring.newest()
    assert newest is not None and newest.version == version
    sender._ring.buffers[newest.slot][100] ^= 0x10


def thread_stacks(threads: list[threading.Thread] | None = None) -> str:
    """Where each of ``threads`` (default: every thread of this process) is now, for a failure's message."""
    frames = sys._current_frames()
    return "\n".join(
        f"--- thread {t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}"
        for t in (threading.enumerate() if threads is None else threads)
        if t.ident in frames
    )
