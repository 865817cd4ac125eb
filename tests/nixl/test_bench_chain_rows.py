"""`bench --hosts --transport gloo --transport nixl --topology chain`, run as a user runs it:
both relays measured in one run, alternating round after round, each row the median of its
rounds with every round's figure, and the refusals of what the bench does not measure."""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import subprocess
import sys

import pytest

from lightning_wsync.testing.hosts import missing_requirements

_REASON = missing_requirements()
if _REASON is None and importlib.util.find_spec("nixl_cu12") is None:
    _REASON = "NIXL is not installed: pip install 'lightning-wsync[nixl]'"
BENCH = [sys.executable, "-m", "lightning_wsync.cli", "bench", "--hosts", "2", "--receivers-per-host", "1"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_chain_rows_alternate_and_carry_every_rounds_figures():
    argv = [*BENCH, "--link", "10gbit", "--size-mb", "4", "--transport", "gloo", "--transport", "nixl",
            "--topology", "chain", "--rounds", "2", "--pushes", "1", "--timeout-s", "60", "--no-reference",
            "--json"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=560, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout[done.stdout.index("{") :])
    config = result["config"]
    assert (config["transports"], config["topologies"], config["rounds"]) == (["gloo", "nixl"], ["chain"], 2)
    phases = result["phases"]
    assert list(phases) == ["gloo/chain", "nixl/chain"]  # --no-reference: no one-host rows
    for transport in ("gloo", "nixl"):
        row = phases[f"{transport}/chain"]
        assert row["ok"] and row["transport"] == transport and row["topology"] == "chain" and row["hosts"] == 2
        rounds = row["latency_s_rounds"]
        assert len(rounds) == 2 and row["latency_s"] == pytest.approx(statistics.median(rounds))
        cpu = row["cpu_s_per_gb_per_hop_rounds"]
        assert len(cpu) == 2 and row["cpu_s_per_gb_per_hop"] == pytest.approx(statistics.median(cpu))
        raw = row["raw_hop"]
        assert raw["transport"] == transport and raw["bytes"] == row["pushed_bytes"]
        if raw["cpu_s_per_gb"] > 0:  # 4 MiB may read in under one 10 ms CPU tick
            assert row["cpu_vs_raw"] == pytest.approx(row["cpu_s_per_gb_per_hop"] / raw["cpu_s_per_gb"])


@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--topology", "tree"], "--topology \\['tree'\\] with --transport: give star and/or chain"),
        (["--topology", "chain", "--rounds", "0"], "--rounds=0 must be >= 1"),
    ],
)
def test_what_the_bench_does_not_measure_is_refused_by_name(extra, message):
    argv = [*BENCH, "--transport", "gloo", "--transport", "nixl", *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert re.search(message, done.stderr), done.stderr[-2000:]
