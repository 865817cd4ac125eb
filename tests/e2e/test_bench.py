"""`lightning-wsync bench` end to end at a tiny size: the report's structure and correctness, not timings.

The bench is a client of the library: these tests drive it as a user does, through the
command (``lightning_wsync.cli.main`` or ``python -m lightning_wsync.cli``), never by
importing its modules.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from lightning_wsync.cli import main
from lightning_wsync.testing.models import build_model, digest, mutate, spec_for_size

MEDIANS = ("stall_s", "core_stall_s", "latency_s", "report_latency_s", "memcpy_s", "memcpy_2t_s", "gather_s",
           "shm_s", "shm_write_s", "tcp_s")  # fmt: skip
RATIOS = ("stall_to_memcpy", "latency_to_shm_bound", "gloo_throughput_to_tcp", "sender_memory_to_pushed",
          "receiver_memory_to_model")  # fmt: skip


def _children_alive() -> list[int]:
    """PIDs of live, non-zombie children of this process (multiprocessing's resource tracker and
    the tests' forkserver, ``tests/support/_spawn.py``, aside)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) != os.getpid() or fields[0] in ("Z", "X"):
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            if b"resource_tracker" in cmdline or b"forkserver" in cmdline:
                continue
        except OSError:
            continue
        alive.append(int(entry))
    return alive


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_store_load_counts_every_request_at_a_proxy_and_idle_links_cost_nothing(capsys):
    """One receiver on this host, one on a simulated host with its own network link: every
    client's requests are parsed at the proxy, pushes arrive bit-exact, and at idle the
    link's ends send the store nothing (before: a check every 2 ms, ~500 requests/s)."""
    before = set(_children_alive())
    code = main(["bench", "--store-load", "--receivers", "1", "--store-hosts", "1", "--receivers-per-host", "1",
                 "--cross-host", "star", "--pushes", "2", "--idle-s", "2", "--json"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out)
    assert result["ok"] and result["problems"] == [] and result["unparsed_connections"] == 0
    assert result["config"]["receivers"] == 2 and len(result["per_push"]["pushes"]) == 2
    idle = result["idle"]["by_command_per_s"]
    assert idle.get("check", 0) < 20, idle  # the sender's goodbye reads (2/s); no link polls
    assert result["idle"]["requests_per_s"] < 150, result["idle"]  # ~70 measured; before: ~650
    for push in result["per_push"]["pushes"]:
        assert push["by_command"].get("set", 0) >= 3, push  # the version's records, notes and acks, counted
    assert set(_children_alive()) <= before


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["auto", "gloo"])
@pytest.mark.slow
def test_bench_json_reports_every_push_applied_bit_exact(transport):
    # In a process of its own, as a user runs it: memory the test process frees during the run
    # (earlier tests' objects) would offset the sender's growth measured (CI once saw 0).
    # Children it left running would keep it from exiting: the timeout would fail the test.
    done = subprocess.run(
        [sys.executable, "-m", "lightning_wsync.cli", "bench", "--size-mb", "4", "--receivers", "2", "--pushes", "2",
         "--transport", transport, "--json"],
        capture_output=True, text=True, timeout=80, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)

    assert result["config"]["transport"] == transport and result["config"]["receivers"] == 2
    model = result["model"]
    spec = spec_for_size(4)
    assert model["tensors"] == spec.n_tensors == 195
    assert model["fp32_bytes"] == spec.nbytes and 0.9 * 4 * 2**20 < spec.nbytes <= 4 * 2**20
    assert model["pushed_bytes"] >= spec.nbytes

    pushes = result["pushes"]
    assert [p["version"] for p in pushes] == [1, 2, 3, 4]
    assert [p["warmup"] for p in pushes] == [True, True, False, False]  # one warm-up per snapshot slot
    for p in pushes:
        assert p["delivered"] == ["r0", "r1"] and p["failed"] == {}
        assert p["applied"] == {"r0": p["version"], "r1": p["version"]}
        assert p["digest_ok"] is True
        # A receiver may apply before push() has returned (it reads the segment header), but
        # never before the snapshot is complete.
        assert p["stall_s"] > 0 and 0 < p["core_stall_s"] <= p["latency_s"]
    assert result["ok"] is True and result["problems"] == []

    assert set(MEDIANS) <= set(result["medians"]) and all(result["medians"][k] > 0 for k in MEDIANS)
    ratios = result["ratios"]
    assert set(RATIOS) <= set(ratios) and all(ratios[k] > 0 for k in RATIOS if "memory" not in k), ratios
    # A receiver's growth can read 0 at this size (pages freed earlier get reused): >= 0, not None.
    assert all(ratios[k] >= 0 for k in RATIOS if "memory" in k), ratios
    assert all(len(result["bounds"][k]) == 2 for k in ("memcpy_s", "shm_s", "tcp_s"))
    names = {t["name"] for t in result["targets"]}
    assert ("gloo_throughput_to_tcp" in names) == (transport == "gloo")
    assert ("latency_to_shm_bound" in names) == (transport != "gloo")

    receivers = result["memory"]["receivers"]
    assert set(receivers) == {"r0", "r1"}
    # The sender's snapshot is visible in its growth. (A receiver's 4 MiB staging buffer
    # is not reliably: the allocator may reuse heap pages freed while building the model.)
    sender_memory = result["memory"]["sender"]
    assert sender_memory["peak_rss_bytes"] >= model["pushed_bytes"] // 2, sender_memory
    if transport == "auto":  # both slots mapped and populated in /dev/shm
        assert sender_memory["shmem_bytes"] >= 2 * model["pushed_bytes"], sender_memory
    assert result["compare"] == {}


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_bench_with_a_cast_also_runs_the_uncast_pushes_and_swap_apply(capsys):
    code = main(["bench", "--size-mb", "4", "--receivers", "2", "--pushes", "2", "--transport", "gloo",
                 "--dtype", "bfloat16", "--apply", "swap", "--bucket-mb", "1", "--json"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out)
    assert result["config"]["apply"] == "swap" and result["config"]["bucket_mb"] == 1
    model = result["model"]
    assert model["pushed_bytes"] < model["fp32_pushed_bytes"] and model["fp32_pushed_bytes"] >= model["fp32_bytes"]
    for pushes in (result["pushes"], result["fp32_pushes"]):
        assert [p["version"] for p in pushes] == [1, 2, 3, 4]
        assert all(p["digest_ok"] and p["delivered"] == ["r0", "r1"] for p in pushes)
    ratios = result["ratios"]
    assert ratios["bytes_to_fp32"] == model["pushed_bytes"] / model["fp32_pushed_bytes"]
    assert ratios["latency_to_fp32"] > 0 and ratios["stall_to_fp32"] > 0
    assert len(result["bounds"]["shm_cast_s"]) == 2
    targets = {t["name"]: t for t in result["targets"]}
    # With a cast the stall is held to the cast-gather bound, and the latency to the byte ratio.
    assert "stall_to_gather" in targets and "stall_to_memcpy" not in targets
    assert targets["latency_to_fp32"]["limit"] == pytest.approx(1.15 * ratios["bytes_to_fp32"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_table_shows_the_uncast_pushes_and_skips_torchrl_when_missing(capsys, monkeypatch):
    # None in sys.modules makes the import fail as if the package were not installed.
    for name in ("tensordict", "torchrl", "torchrl.weight_update"):
        monkeypatch.setitem(sys.modules, name, None)
    code = main(["bench", "--size-mb", "2", "--receivers", "1", "--pushes", "1", "--dtype", "bfloat16",
                 "--compare", "torchrl"])  # fmt: skip
    table = capsys.readouterr().out
    assert code == 0, table
    assert re.search(r"^push latency \(push\(\) -> applied everywhere\) +\d+\.\d{4} +\d+\.\d{2}$", table, re.M), table
    assert re.search(r"^float32 push \(no cast\): latency +\d+\.\d{4}", table, re.M), table
    assert (
        "compare torchrl: torchrl is not installed; `pip install lightning-wsync[torchrl]` to compare with it "
        "(skipped)" in table
    )
    assert "correctness: 3 pushes (+3 without the cast), every one applied bit-exact by every receiver" in table


def test_digest_sees_wire_rounding_but_not_equal_copies():
    spec = spec_for_size(1)
    a, b = build_model(spec, seed=3), build_model(spec, seed=3)
    assert digest(a) == digest(b)
    mutate(b, 1)
    assert digest(a) != digest(b)
    c = build_model(spec, seed=3)
    with torch.no_grad():
        for t in c.state_dict().values():
            t.copy_(t.to(torch.bfloat16).to(torch.float32))
    assert digest(c) != digest(a)
    assert digest(c, torch.bfloat16) == digest(a, torch.bfloat16)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--size-mb", "0.5"], r"--size-mb=0.5 must be >= 1"),
        (["--receivers", "0"], r"--receivers=0 must be >= 1"),
        (["--pushes", "0"], r"--pushes=0 must be >= 1"),
        (["--timeout-s", "0"], r"--timeout-s=0.0 must be > 0"),
        (["--bucket-mb", "0"], r"--bucket-mb=0.0 must be > 0"),
        (["--interval-ms", "-1"], r"--interval-ms=-1.0 must be >= 0"),
        (["--duration-s", "0"], r"--duration-s=0.0 must be > 0"),
        (["--trainer-ranks", "1"], r"--trainer-ranks=1 must be >= 2"),
        (["--store-load", "--idle-s", "0"], r"--idle-s=0.0 must be > 0"),
        (["--store-load", "--store-hosts", "-1"], r"--store-hosts=-1 must be >= 0"),
        (["--transport", "gloo", "--transport", "nixl"], r"--transport more than once needs --hosts"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(capsys, argv, match):
    assert main(["bench", *argv]) == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.timeout(60)
def test_the_bench_command_runs_as_a_module_and_exits_2_on_a_bad_flag():
    done = subprocess.run(
        [sys.executable, "-m", "lightning_wsync.cli", "bench", "--receivers", "0"],
        capture_output=True, text=True, timeout=50, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "lightning-wsync bench: --receivers=0 must be >= 1, e.g. --receivers 4"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["auto", "gloo"])
@pytest.mark.slow
def test_bench_interval_reports_applied_fraction_and_age_per_receiver(capsys, transport):
    code = main(["bench", "--size-mb", "1", "--receivers", "2", "--interval-ms", "2", "--duration-s", "1",
                 "--transport", transport, "--json"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out)
    assert result["ok"] is True and result["interval_ms"] == 2 and result["pushes"] >= 1
    assert result["published"] + result["dropped"] == result["pushes"]
    assert set(result["receivers"]) == {"r0", "r1"}
    for r in result["receivers"].values():
        assert r["bit_exact"] is True  # the final version, on every receiver
        assert 0 < r["applied"] <= result["published"] and 0 < r["applied_fraction"] <= 1
        assert r["age_median_s"] is not None and 0 <= r["age_median_s"] <= r["age_p95_s"]


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_trainer_ranks_bench_reports_every_configuration(capsys):
    argv = ["bench", "--trainer-ranks", "2", "--strategy", "fsdp", "--size-mb", "2", "--pushes", "1",
            "--receivers", "1", "--timeout-s", "60", "--json", "--profile-threads"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["config"] for r in result["rows"]] == ["1 rank", "2 ranks, fsdp, sharded=False", "2 ranks, fsdp, default"]
    assert [r["sharded_push"] for r in result["rows"]] == [False, False, True]  # the default shards FSDP2 x 2
    assert [r["unsharded_reason"] for r in result["rows"]] == [
        "one trainer rank: its share would be the whole version", "sharded=False", None]
    for row in result["rows"]:
        assert row["stall_s"] > 0 and row["delivery_s"] is not None and row["delivery_s"] > 0, row
        ranks = 1 if row["config"] == "1 rank" else 2
        assert len(row["rank_stall_s"]) == len(row["rank_peak_rise_mib"]) == len(row["rank_push_rise_mib"]) == ranks
        # CPU per push: the median over pushes of the largest rank's, so at least each rank's own median.
        assert len(row["rank_cpu_s"]) == ranks and 0 < min(row["rank_cpu_s"]), row
        assert row["cpu_s"] >= max(row["rank_cpu_s"]), row
        assert row["cpu_vs_one_rank"] is not None and row["cpu_vs_one_rank"] > 0, row
        assert all(0 <= m <= x for m, x in zip(row["rank_push_rise_mib"], row["rank_push_rise_max_mib"])), row
        # --profile-threads: per rank, the threads that ran in its hooks, by process and name
        assert [p["rank"] for p in row["threads"]] == list(range(ranks)), row
        for p in row["threads"]:
            assert p["window_ms"] > 0 and p["own_cpu_ms"] > 0 and p["bench_cpu_ms"] >= p["own_cpu_ms"], p
            assert f"rank{p['rank']}:MainThread" in p["threads_ms"], p  # the rank's own training thread
            assert [o["rank"] for o in p["other_ranks"]] == [r for r in range(ranks) if r != p["rank"]], p
    assert not _children_alive()


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_gpu_bench_parts_run_bit_exact_on_the_cpu(capsys):
    """``bench --gpu``'s pushes and Lightning run, with the module on the CPU (where CI has no
    GPU): every version reaches both receivers bit-exact, the trainer's last version too."""
    code = main(["bench", "--gpu", "--device", "cpu", "--size-mb", "4", "--pushes", "1", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out.splitlines()[-1])
    assert result["device"] == "cpu" and "bounds" not in result  # the copy bounds need a GPU
    for part, share in (("push", 1.0), ("push-bf16", 0.5), ("push-gloo", 1.0)):
        run = result[part]
        assert run["all_bit_exact"] and run["all_delivered"], run
        assert [p["version"] for p in run["pushes"]] == [1, 2, 3]
        # of the float32 bytes, plus each tensor's alignment
        assert share * spec_for_size(4).nbytes <= run["pushed_bytes"] < (share + 0.01) * spec_for_size(4).nbytes
    assert {k: result["lightning"][k] for k in ("version", "want", "bit_exact")} == {
        "version": 8, "want": 8, "bit_exact": True}  # fmt: skip


def test_gpu_bench_without_a_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert main(["bench", "--gpu", "--size-mb", "4"]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
