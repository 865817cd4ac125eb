"""The NIXL plane's GPU mirror, the parts that run without a GPU: the owner's record with and
without mirror regions, an old record's parse, and a reader's choice between the device path
and host memory (tests/nixl/test_nixl_gpu.py runs the device path itself, on a GPU)."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_wsync._control.manifest import build_manifest
from lightning_wsync._control.records import DeviceRegion, NixlAgentRecord, RecordShape
from lightning_wsync._control.store import Control
from lightning_wsync._planes.nixl.agent import unusable
from lightning_wsync._planes.nixl.receive import NixlReader, mirror_refused, module_device

HOST = ((4096, 4096), (8192, 100), (16384, 100))
MIRROR = (DeviceRegion(1 << 40, 100, 0), DeviceRegion((1 << 40) + 100, 100, 0))


def test_a_record_with_a_mirror_round_trips_and_one_without_writes_no_mirror_key():
    lent = NixlAgentRecord("wsync-s1-5-j", 5, "QUJD", HOST, MIRROR)
    encoded = lent.encode()
    assert encoded["mirror"] == [[1 << 40, 100, "VRAM", 0], [(1 << 40) + 100, 100, "VRAM", 0]]  # type: ignore[index]
    assert NixlAgentRecord.decode(encoded) == lent
    plain = NixlAgentRecord("wsync-s1-5-j", 5, "QUJD", HOST)
    assert "mirror" not in plain.encode()  # type: ignore[operator]
    assert NixlAgentRecord.decode(plain.encode()) == plain


def test_an_old_record_without_the_mirror_key_loads_with_no_mirror():
    old = {"name": "wsync-s1-5-j", "pid": 5, "metadata": "QUJD", "regions": [[4096, 4096], [8192, 100]]}
    record = NixlAgentRecord.decode(old)
    assert record.mirror == () and record.regions == ((4096, 4096), (8192, 100))


@pytest.mark.parametrize(("mirror", "match"), [
    ([[1 << 40, 100, "DRAM", 0]], r"mirror\[\] memory kind 'DRAM' is not one of \('VRAM',\)"),
    ([[1 << 40, 100, "VRAM", -1]], r"mirror\[\] device -1 is not a CUDA device index"),
    ([[1 << 40, 100, "VRAM", "0"]], r"mirror\[\]\[3\]='0' is not an integer"),
    ([[1 << 40, 100, 0]], r"mirror\[\] entry .* is not \[address, bytes, kind, device\]"),
    ([[0, 100, "VRAM", 0]], r"region \[0, 100\] is not a positive address and size"),
    ([[1 << 40, 0, "VRAM", 0]], r"region \[1099511627776, 0\] is not a positive address and size"),
    ("x", r"mirror='x' is not a list"),
])  # fmt: skip
def test_bad_mirror_regions_are_refused_saying_what(mirror, match):
    encoded = {**NixlAgentRecord("wsync-s1-5-j", 5, "QUJD", HOST).encode(), "mirror": mirror}  # type: ignore[dict-item]
    with pytest.raises(RecordShape, match=match):
        NixlAgentRecord.decode(encoded)


def test_the_module_device_is_its_one_gpu_or_none():
    assert module_device([torch.zeros(2), torch.zeros(3)]) is None
    assert module_device([torch.zeros(2), torch.zeros(2, device="meta")]) is None
    assert module_device([torch.zeros(2, device="meta")]) is None


@pytest.mark.parametrize(("device", "mirror", "why"), [
    (None, MIRROR, "the module is not on one CUDA device"),
    (torch.device("cuda", 0), (), "the sender lends no GPU mirror (it runs without cuda_ipc=True"),
    (torch.device("cuda", 0), MIRROR[:1], "the sender's GPU mirror"),
    (torch.device("cuda", 0), (MIRROR[0], MIRROR[1]._replace(size=99)), "does not fit this layout"),
])  # fmt: skip
def test_why_a_reader_reads_host_memory(device, mirror, why):
    record = NixlAgentRecord("wsync-s1-5-j", 5, "QUJD", HOST, mirror)
    got = mirror_refused(device, record, 100)
    assert got is not None and why in got


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is usable here: tests/nixl/test_nixl_gpu.py")
def test_a_mirror_that_fits_needs_cuda_in_this_process():
    record = NixlAgentRecord("wsync-s1-5-j", 5, "QUJD", HOST, MIRROR)
    assert mirror_refused(torch.device("cuda", 0), record, 100) == "CUDA is not usable in this process"


@pytest.mark.skipif(unusable() is not None, reason=f"{unusable()}")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", [None, torch.device("cuda", 0)])
def test_a_reader_given_a_mirror_it_cannot_use_reads_host_memory_and_says_why_once(server, caplog, device):
    """A real reader (its own NIXL agent) offered an owner's mirror: with its module on the CPU, or
    with no CUDA in this process, it READs host memory, says why at INFO, and describes itself as
    plain NIXL."""
    if device is not None and torch.cuda.is_available():
        pytest.skip("CUDA is usable here: tests/nixl/test_nixl_gpu.py")
    ctl = Control(server, "mirror-choice")
    layout = build_manifest({"w": torch.zeros(25)}, None, 1 << 20)
    reader = NixlReader(ctl, layout, epoch=1, rid=3, timeout_s=5.0, chunk_bytes=1 << 16, newest=lambda: None,
                        on_staged=lambda v: None, on_rejected=lambda v, why: None, device=device)  # fmt: skip
    try:
        nbytes = layout.total_bytes
        record = NixlAgentRecord("wsync-s1-5-j", 5, "QUJD", ((4096, 4096), (8192, nbytes), (16384, nbytes)),
                                 (DeviceRegion(1 << 40, nbytes, 0), DeviceRegion((1 << 40) + nbytes, nbytes, 0)))
        with caplog.at_level(logging.INFO, logger="lightning_wsync._planes.nixl.receive"):
            reader._choose(record)
        want = "the module is not on one CUDA device" if device is None else "CUDA is not usable in this process"
        assert reader.host_reason == want
        said = [r for r in caplog.records if "READing versions through host memory" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.INFO and want in said[0].getMessage()
        assert reader.describe() == "NIXL"
        assert not reader.halves[0].is_cuda
    finally:
        reader.close()
