"""CUDA paths: run where a GPU exists, skipped cleanly elsewhere."""

from __future__ import annotations

import pytest
import torch
from _spawn import CTX
from _workers import Inbox, big_model, collect, digest, mutate, receiver_main

from lightning_wsync import WeightReceiver, WeightSender

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL pairs two ranks on two GPUs")


def cuda_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64).to(torch.bfloat16))
    m.register_buffer("steps", torch.arange(4))
    return m.cuda()


@needs_cuda
def test_cuda_module_through_host_shared_memory(port):
    src, dst = cuda_model(0), cuda_model(1)
    store = f"127.0.0.1:{port}"
    with WeightSender(src, store=store, job="gpu-shm", timeout_s=10) as sender:
        with WeightReceiver(dst, store=store, job="gpu-shm") as receiver:
            for version in (1, 2):
                mutate(src, version)
                handle = sender.push(version)
                assert receiver.wait_for_version(version, timeout_s=30) == version
                assert handle.wait(10).delivered == (receiver.name,)
                assert digest(dst) == digest(src)


@needs_two
def test_nccl_between_two_gpus(port, children):
    ctx = CTX
    inbox = Inbox(ctx)
    src = cuda_model(0)
    store = f"127.0.0.1:{port}"
    with WeightSender(src, store=store, job="gpu-nccl", transport="nccl", timeout_s=30) as sender:
        p = ctx.Process(target=receiver_main, daemon=True,
                        args=(store, "gpu-nccl", "r", ("cuda1", 1), inbox.queue("r"), {}))  # fmt: skip
        p.start()
        children.track(p.pid)
        collect(inbox, "ready", {"r"}, timeout_s=120)
        for version in (1, 2):
            mutate(src, version)
            assert sender.push(version).wait(60).delivered == ("r",)
            assert collect(inbox, "version", {"r"}, 60)["r"][2:4] == (version, digest(src))


@needs_cuda
def test_snapshot_slots_are_registered_with_cuda_and_a_refusal_leaves_cuda_usable(caplog):
    from lightning_wsync._planes.shm import cuda_host

    buffer = torch.empty(8 << 20, dtype=torch.uint8)
    first = cuda_host.register(buffer, read_only=False, what="test ring")
    assert first is not None and buffer.is_pinned()
    # Registering the same range again is refused (cudaErrorHostMemoryAlreadyRegistered):
    # logged with CUDA's code, and the error must not surface in the next kernel launch.
    with caplog.at_level("WARNING", logger=cuda_host.__name__):
        assert cuda_host.register(buffer, read_only=False, what="test ring") is None
    assert "test ring: cannot register 8.0 MiB of shared memory with CUDA (cudaError" in caplog.text
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    assert float((x * 2).sum()) == 999000.0  # a kernel launch after the refusal
    src = torch.arange(8 << 20, device="cuda", dtype=torch.int64).to(torch.uint8)
    buffer.copy_(src, non_blocking=True)
    cuda_host.wait_for_copies()
    assert torch.equal(buffer, src.cpu())
    first.release()
    assert not buffer.is_pinned()


@needs_cuda
def test_a_readers_read_only_mapping_is_registered_too(caplog):
    from lightning_wsync._planes.shm.segment import ShmSegment, segment_name

    writer = ShmSegment(segment_name("gpu-test", 0), 4 << 20, create=True)
    reader = ShmSegment(writer.name, 4 << 20, create=False)
    try:
        with caplog.at_level("WARNING"):
            writer.register_cuda()
            reader.register_cuda()  # mapped read-only: registered with cudaHostRegisterReadOnly
        assert "cannot register" not in caplog.text
        assert writer.data[0].is_pinned() and reader.data[1].is_pinned()
        writer.data[1].copy_(torch.full((4 << 20,), 7, dtype=torch.uint8, device="cuda"), non_blocking=True)
        torch.cuda.synchronize()
        back = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
        back.copy_(reader.data[1], non_blocking=True)
        assert int(back.sum()) == 7 * (4 << 20)
    finally:
        reader.close()
        writer.close()


@needs_cuda
@pytest.mark.parametrize(("transport", "cuda_ipc"), [("auto", False), ("gloo", False), ("auto", True)])
def test_pushes_overlapping_a_gpu_receivers_applies_are_each_bit_exact(port, children, transport, cuda_ipc):
    """A GPU module pushed back to back while a receiver in another process applies each
    version into its own GPU module from the registered slots: every version it reports
    holds exactly that version's bytes (an asynchronous copy that outlived its pin would
    show a torn version here). Over gloo the receiver stages each version in page-locked
    memory, and the next receive must not start into it while the copy to the GPU runs.
    With cuda_ipc the receiver copies from the trainer's GPU slots (device to device)
    under the same pins, and says so."""
    ctx = CTX
    inbox = Inbox(ctx)
    store = f"127.0.0.1:{port}"
    src = big_model(64).cuda()
    expected: dict[int, str] = {}
    with WeightSender(src, store=store, job="gpu-overlap", timeout_s=30, transport=transport,
                      cuda_ipc=cuda_ipc) as sender:  # fmt: skip
        p = ctx.Process(target=receiver_main, daemon=True,
                        args=(store, "gpu-overlap", "r", ("big-cuda0", 64), inbox.queue("r"), {}))  # fmt: skip
        p.start()
        children.track(p.pid)
        collect(inbox, "ready", {"r"}, timeout_s=120)
        for version in range(1, 41):
            mutate(src, version)
            expected[version] = digest(src)
            # No wait for delivery: the next write overlaps the receiver's apply of this one.
            assert not sender.push(version, wait_for_slot_s=10).dropped
        seen = []
        while not seen or seen[-1] < 40:
            version, got, _rss, plane = collect(inbox, "version", {"r"}, 60)["r"][2:6]
            assert got == expected[version], f"version {version} torn on the GPU receiver"
            seen.append(version)
    assert seen == sorted(set(seen)) and seen[-1] == 40
    assert ("CUDA IPC" in plane) == cuda_ipc, plane


@needs_cuda
def test_cuda_ipc_in_the_senders_own_process_copies_from_host_memory(port):
    """CUDA opens no IPC handle in the process that made it: a receiver beside the sender
    in one process takes the host slots, bit-exact, and CUDA stays usable."""
    src, dst = cuda_model(0), cuda_model(1)
    store = f"127.0.0.1:{port}"
    with WeightSender(src, store=store, job="gpu-ipc-self", timeout_s=10, cuda_ipc=True) as sender:
        with WeightReceiver(dst, store=store, job="gpu-ipc-self") as receiver:
            for version in (1, 2):
                mutate(src, version)
                sender.push(version).wait(10)
                assert receiver.wait_for_version(version, timeout_s=30) == version
                assert digest(dst) == digest(src)
            assert receiver._watcher.source.describe() == "shared memory"
    torch.ones(4, device="cuda").sum().item()


@needs_cuda
@pytest.mark.parametrize("cuda_ipc", [False, True])
def test_sharded_shares_written_from_gpu_tensors_reach_a_gpu_receiver_bit_exact(port, children, cuda_ipc):
    """Two shares of one CUDA module (as two trainer ranks would write them, each through its
    own registered ring and copy stream) assembled by a receiver whose module is on the GPU:
    in this process from the host slots, and in another process, with cuda_ipc, from each
    share's GPU mirror."""
    import dataclasses

    from lightning_wsync._planes.shares import ShareWriter
    from lightning_wsync._push.shares import prepare_shares
    from lightning_wsync.config import SenderConfig

    src, dst = big_model(16).cuda(), big_model(16).cuda()
    for t in dst.state_dict().values():
        t.detach().zero_()
    store = f"127.0.0.1:{port}"
    cfg = SenderConfig(job="gpu-sharded", timeout_s=10, cuda_ipc=cuda_ipc)
    mine, theirs = prepare_shares(src, cfg, 0, 2), prepare_shares(src, cfg, 1, 2)
    writer = ShareWriter(theirs, cfg)
    try:
        shares = dataclasses.replace(mine, plan=mine.plan.with_segments(["", writer.name]))
        if cuda_ipc:
            with WeightSender(src, store=store, config=cfg, shares=shares) as sender:
                ctx = CTX
                inbox = Inbox(ctx)
                p = ctx.Process(target=receiver_main, daemon=True, args=(
                    store, "gpu-sharded", "r", ("big-cuda0", 16), inbox.queue("r"), {"verify": True}))  # fmt: skip
                p.start()
                children.track(p.pid)
                collect(inbox, "ready", {"r"}, timeout_s=120)
                for version in (1, 2, 3):
                    mutate(src, version)
                    assert writer.write(version)
                    report = sender.push(version).wait(timeout_s=30)
                    _, _, got, dig, _rss, plane = collect(inbox, "version", {"r"}, 60)["r"]
                    assert (got, dig) == (version, digest(src)) and report.failed == {}, report
                assert "CUDA IPC" in plane, plane
            return
        with WeightSender(src, store=store, config=cfg, shares=shares) as sender, \
                WeightReceiver(dst, store=store, job="gpu-sharded", timeout_s=10, verify=True) as receiver:
            for version in (1, 2, 3):
                mutate(src, version)
                assert writer.write(version)
                handle = sender.push(version)
                assert receiver.wait_for_version(version, timeout_s=30) == version  # applied in this thread
                report = handle.wait(timeout_s=10)
                assert digest(dst) == digest(src) and report.failed == {}, report
    finally:
        writer.close()


@needs_cuda
def test_closing_a_reader_under_its_gpu_copies_never_unregisters_a_copy_in_flight():
    """A receiver that switches sources closes the old segment from another thread while an
    apply may be copying from it: the registration is let go between copies, never under one."""
    import threading

    from lightning_wsync._planes.shm.segment import ShmSegment, segment_name

    writer = ShmSegment(segment_name("gpu-close", 0), 64 << 20, create=True)
    writer.data[0].fill_(3)
    reader = ShmSegment(writer.name, 64 << 20, create=False)
    reader.register_cuda()
    src, dst = [reader.data[0]], [torch.empty(64 << 20, dtype=torch.uint8, device="cuda")]
    errors: list[BaseException] = []
    started = threading.Event()

    def copies() -> None:
        try:
            for _ in range(40):
                reader.copy_to_gpu(dst, src)
                started.set()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=copies)
    thread.start()
    assert started.wait(30)
    reader.close()  # while the copies go on: later ones copy from pageable memory
    thread.join(60)
    assert not thread.is_alive() and errors == []
    assert int(dst[0].sum()) == 3 * (64 << 20)
    writer.close()
