"""Experience channel: encoding, bound, and producers in other processes."""

from __future__ import annotations

import pytest
import torch
from _spawn import CTX
from _workers import writer_main
from torch.utils.data import DataLoader

from lightning_wsync import WeightSyncTimeoutError
from lightning_wsync.channel import ExperienceReader, ExperienceWriter, decode, encode
from lightning_wsync.testing.stores import host_store

pytestmark = pytest.mark.timeout(120)


def test_roundtrip_keeps_dtypes_shapes_and_version():
    sample = {
        "obs": torch.randn(5, 4),
        "act": torch.tensor([1, 0, 1], dtype=torch.int64),
        "h": torch.randn(2, 2).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
    }
    out = decode(encode(sample, version=42))
    assert int(out.pop("version")) == 42
    assert out.keys() == sample.keys()
    for k in sample:
        assert out[k].dtype == sample[k].dtype and torch.equal(out[k], sample[k])


def test_reserved_key_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="key 'version' is reserved"):
        encode({"version": torch.zeros(1)}, 1)
    with pytest.raises(TypeError, match="'x' is list, expected a torch.Tensor"):
        encode({"x": [1, 2]}, 1)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="capacity=0 must be an int >= 1"):
        ExperienceWriter(store="127.0.0.1:1", job="j", capacity=0)


def test_bounded_queue_drops_or_times_out(port):

    server = host_store("127.0.0.1", port, timeout_s=300)
    writer = ExperienceWriter(store=f"127.0.0.1:{port}", job="b", capacity=2, timeout_s=0.2)
    assert writer.put({"x": torch.ones(1)}, 1) and writer.put({"x": torch.ones(1)}, 2)
    assert writer.put({"x": torch.ones(1)}, 3, block=False) is False and writer.dropped == 1
    with pytest.raises(WeightSyncTimeoutError, match="channel 'experience' stayed full \\(capacity=2\\)"):
        writer.put({"x": torch.ones(1)}, 4)
    reader = ExperienceReader(store=f"127.0.0.1:{port}", job="b", max_items=2, idle_timeout_s=5)
    assert [int(item["version"]) for item in reader] == [1, 2]
    del server


@pytest.mark.slow
def test_two_producer_processes_feed_a_dataloader(port, children):

    server = host_store("127.0.0.1", port, timeout_s=300)
    ctx = CTX
    procs = [ctx.Process(target=writer_main, args=(f"127.0.0.1:{port}", "dl", p, 10), daemon=True) for p in (0, 1)]
    for p in procs:
        p.start()
        children.track(p.pid)
    reader = ExperienceReader(store=f"127.0.0.1:{port}", job="dl", max_items=20, idle_timeout_s=60)
    seen = []
    for item in DataLoader(reader, batch_size=None):
        producer, i = item["who"].tolist()
        assert int(item["version"]) == i
        assert torch.equal(item["x"], torch.full((3,), float(i), dtype=torch.bfloat16))
        seen.append((producer, i))
    assert sorted(seen) == [(p, i) for p in (0, 1) for i in range(10)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    del server
