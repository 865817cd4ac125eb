"""The RDMA push-time model (docs/rdma-model.md): its arithmetic, pinned by hand-computed cases."""

from __future__ import annotations

import pytest

from lightning_wsync.testing.rdmamodel import Model, Rdma, delta_push_s, full_push_s, gpu_codec, levels, share_bytes


def test_full_push_is_the_wire_time_of_one_share_plus_levels_and_the_copy() -> None:
    model = Model("toy", 8e9, gpus_per_engine=8)  # 16 GB in bf16, 2 GB a share
    rdma = Rdma(nic_gbit_s=400, read_efficiency=1.0, chunk_bytes=50e6, fixed_s=0.0, copy_gb_s=1000.0)
    assert share_bytes(model) == 2e9
    assert levels(1024, model) == 7  # 128 engines: two trees of 8 levels, 7 below the roots
    rate = 50e9
    expected = 2e9 / rate + 7 * (2 * 50e6 / rate + rdma.hop_s) + 2e9 / 1e12
    assert full_push_s(model, 1024, rdma) == pytest.approx(expected)


def test_a_faster_nic_halves_the_wire_part_only() -> None:
    model = Model("235B", 235e9, gpus_per_engine=8)
    slow, fast = full_push_s(model, 1000, Rdma(nic_gbit_s=200)), full_push_s(model, 1000, Rdma(nic_gbit_s=400))
    wire_200 = share_bytes(model) / Rdma(nic_gbit_s=200).rate
    assert slow - fast == pytest.approx(wire_200 / 2, rel=0.05)


def test_deltas_pay_only_when_the_codec_outruns_the_wire() -> None:
    model = Model("70B", 70e9, gpus_per_engine=8)
    rdma = Rdma(nic_gbit_s=400)
    full = full_push_s(model, 4096, rdma)
    # The CPU codec (2.0 GB/s a core, 8 cores a share) is slower than a 400 Gbit/s NIC.
    assert delta_push_s(model, 4096, rdma, wire_fraction=0.018) > full
    # A codec at 300 GB/s makes the encode the pace, well under the full share's wire time.
    assert delta_push_s(model, 4096, gpu_codec(rdma), wire_fraction=0.018) < full / 2


def test_the_tree_depth_grows_with_log2_of_the_engines() -> None:
    model = Model("1T", 1e12, gpus_per_engine=32)
    assert [levels(g, model) for g in (32, 64, 1000, 4096)] == [0, 1, 4, 7]
