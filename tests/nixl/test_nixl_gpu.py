"""The NIXL plane's GPU mirror on a GPU: a sender on cuda:0 with ``cuda_ipc=True`` lends its
ring's GPU mirror to NIXL, and a receiver in its own process on the same GPU, on another
(simulated) host, READs each version device to device. Skipped, saying why, without CUDA or
without NIXL (docs/nixl.md: what runs where)."""

from __future__ import annotations

import pytest
import torch
from _nixl_workers import remote_receiver_main
from _spawn import CTX
from _workers import Inbox, big_model, collect, digest, mutate

from lightning_wsync import WeightSender
from lightning_wsync._planes.nixl.agent import unusable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(unusable() is not None, reason=f"{unusable()}"),
]


@pytest.mark.parametrize(("spec", "plane"), [
    (("big-cuda0", 16), "NIXL (device mirror)"),  # the receiver's module on cuda:0: READs from the mirror
    (("big", 16), "NIXL"),  # its module on the CPU: READs the host slots, as without a mirror
])  # fmt: skip
def test_a_gpu_receiver_reads_the_senders_gpu_mirror_bit_exact(children, port, spec, plane):
    """Three versions, each bit-exact (digests of the whole module) in the receiver, through the
    path its module's device calls for; the sender lends the mirror either way."""
    src = big_model(16).cuda()
    store = f"127.0.0.1:{port}"
    results = Inbox(CTX)
    with WeightSender(src, store=store, job="nixl-gpu", transport="nixl", cuda_ipc=True, timeout_s=30) as sender:
        p = CTX.Process(target=remote_receiver_main, daemon=True,
                        args=(store, "nixl-gpu", "r", spec, results.queue("r"), {}))  # fmt: skip
        p.start()
        children.track(p.pid)
        collect(results, "ready", {"r"}, timeout_s=120)
        for version in (1, 2, 3):
            mutate(src, version)
            want = digest(src)
            report = sender.push(version).wait(timeout_s=60)
            assert report.delivered == ("r",), report
            got = collect(results, "version", {"r"}, timeout_s=60)["r"]
            assert (got[2], got[3]) == (version, want), f"version {version} differs on the receiver"
            assert got[5].split(" (last failure")[0] == plane, got  # the path its reader took
    p.join(timeout=60)
    assert p.exitcode == 0
