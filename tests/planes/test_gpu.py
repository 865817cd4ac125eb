"""CUDA paths: run where a GPU exists, skipped cleanly elsewhere."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from _workers import Inbox, collect, digest, mutate, receiver_main

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
    ctx = mp.get_context("spawn")
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
