"""`bench --hosts --transport gloo`: a push's CPU is the plane's, from push() until every
receiver applied it; the bench's own model change and digests are counted apart."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from lightning_wsync.testing.hosts import missing_requirements

_REASON = missing_requirements()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]  # fmt: skip


def test_bench_counts_the_planes_cpu_apart_from_its_own_work():
    argv = [sys.executable, "-m", "lightning_wsync.cli", "bench", "--hosts", "1", "--receivers-per-host", "1",
            "--link", "10gbit", "--size-mb", "64", "--transport", "gloo", "--pushes", "2", "--timeout-s", "60",
            "--no-reference", "--json"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    phase = json.loads(done.stdout)["phases"]["gloo"]
    assert phase["ok"] and phase["receivers"] == 1
    samples = phase["samples"]
    assert [s["version"] for s in samples] == [1, 2, 3]
    # Nested windows over monotonic counters: the plane's is inside the one with the bench's
    # work (an add_ over the model, an xxh3-128 digest in the trainer and in the receiver:
    # three passes over 64 MiB, ~0.03 CPU-s a push here, 10 ms ticks).
    assert all(0 < s["cpu_s"] <= s["cpu_s_with_bench"] for s in samples), samples
    assert sum(s["cpu_s_with_bench"] - s["cpu_s"] for s in samples) >= 0.03, samples
    per_gb = statistics.median(s["cpu_s"] for s in samples if not s["warmup"]) / (phase["pushed_bytes"] / 1e9)
    assert phase["cpu_s_per_gb_per_hop"] == pytest.approx(per_gb)
    raw = phase["raw_hop"]
    assert raw["transport"] == "gloo" and raw["bytes"] == phase["pushed_bytes"] and raw["cpu_s_per_gb"] > 0
    assert phase["cpu_vs_raw"] == pytest.approx(phase["cpu_s_per_gb_per_hop"] / raw["cpu_s_per_gb"])
