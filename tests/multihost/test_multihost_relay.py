"""One network copy per host, relayed host to host: simulated hosts on shaped links."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _netns import ROOT, run_scenario, skip_without_netns

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_relay_sends_one_copy_per_push_and_delivers_bit_exact() -> None:
    """4 hosts x 2 receivers, 64 MiB on 700 Mbit/s links, through ``lightning-wsync bench --hosts``."""
    skip_without_netns()
    argv = [sys.executable, "-m", "lightning_wsync.cli", "bench", "--hosts", "4", "--receivers-per-host", "2",
            "--link", "700mbit", "--size-mb", "64", "--pushes", "2", "--topology", "relay", "--no-reference",
            "--timeout-s", "150", "--json"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSYNC_")}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        pytest.fail("bench --hosts ran past 400 s")
    assert proc.returncode == 0, err.decode(errors="replace")[-4000:]
    relay = json.loads(out)["phases"]["relay"]
    assert relay["ok"] and relay["receivers"] == 8
    for sample in relay["samples"]:
        assert sample["digest_ok"] and not sample["failed"]
    assert relay["egress_models_per_push"] <= 1.25, relay
    # Pipelined hops: a chain that stored each version before forwarding it would take ~4x the
    # wire bound on 4 hosts. The figure itself (1.1-1.3x on a quiet machine) is the bench's to
    # report; this bound only catches a lost pipeline (it read 1.56x once under CI load).
    assert relay["latency_vs_wire_bound"] <= 2.5, relay
    # The receivers' store requests are counted at a proxy: every push asks the store something
    # (the version's records), and the idle rate is a finite figure per host.
    assert all(s["store_requests"] > 0 for s in relay["samples"]), relay["samples"]
    assert relay["store_requests_per_push"] > 0 and relay["store_idle_requests_per_s_per_host"] >= 0, relay
    # The idle window's requests by command and key pattern: what asks at idle, counted (each a
    # TCPStore command and a key of this job; the rate is theirs over the window).
    by_key = relay["store_idle_requests_by_key"]
    assert (sum(by_key.values()) > 0) == (relay["store_idle_requests_per_s"] > 0), relay
    for pattern, n in by_key.items():
        command, key = pattern.split(" ", 1)
        assert command.replace("_", "").isalpha() and key.startswith("/wsync/bench-"), by_key
        assert isinstance(n, int) and n > 0, by_key


def _bench_hosts(args: list[str], timeout_s: float) -> dict[str, Any]:
    """``lightning-wsync bench --hosts ... --json`` in its own session; its JSON output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSYNC_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, "-m", "lightning_wsync.cli", "bench", *args, "--json"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        pytest.fail(f"bench {' '.join(args)} ran past {timeout_s} s")
    assert proc.returncode == 0, err.decode(errors="replace")[-4000:]
    result: dict[str, Any] = json.loads(out)
    return result


@pytest.mark.timeout(150)
def test_relay_delta_bench_pushes_adamw_versions_as_deltas_bit_exact() -> None:
    """``bench --hosts --delta``: the same AdamW versions through the relay, full and as deltas, on shaped links."""
    skip_without_netns()
    result = _bench_hosts(["--hosts", "2", "--receivers-per-host", "1", "--link", "700mbit", "--delta",
                           "--dtype", "bfloat16", "--lr", "1e-6", "--size-mb", "16", "--pushes", "3",
                           "--timeout-s", "60"], timeout_s=120)  # fmt: skip
    assert result["ok"] and result["config"]["delta_mode"] == "auto"
    full_bytes = result["model"]["full_bytes"]
    assert [p["version"] for p in result["pushes"]] == [2, 3, 4]
    for push in result["pushes"]:
        full, delta = push["full"], push["delta"]
        assert full["bit_exact"] and delta["bit_exact"] and not full["failed"] and not delta["failed"], push
        assert full["delta_receivers"] == [] and full["delta_bytes"] is None, push
        assert delta["delta_receivers"] == ["h1r0", "h2r0"], push
        assert 0 < delta["delta_bytes"] < 0.25 * full_bytes, push
        assert 0 < delta["delta_changed_share"] < 0.25 and delta["delta_encode_s"] > 0, push
        assert len(full["hop_bytes"]) == len(delta["hop_bytes"]) == 2, push
        for full_hop, delta_hop in zip(full["hop_bytes"], delta["hop_bytes"]):
            assert full_hop >= full_bytes > 4 * delta_hop >= 4 * delta["delta_bytes"], push  # each hop carried it once
        assert delta["egress_bytes"] < full["egress_bytes"] < 1.25 * full_bytes, push
        assert full["latency_s"] > 0 and delta["latency_s"] > 0, push
    medians = result["medians"]
    assert medians["latency_ratio"] == medians["full_latency_s"] / medians["delta_latency_s"]
    assert medians["delta_hop_bytes"] < 0.25 * medians["full_hop_bytes"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("size_mb", "link"),
    [
        pytest.param(16, "300mbit", id="16MiB"),
        # A version of 80 MiB (1 MiB chunks, the minimum; 576 KiB before 2026-11-29): the same
        # failure, no torn version applied anywhere. (At 144 MiB, 1152 KiB chunks, CI once saw
        # versions 3 and 4 reach nobody within timeout_s after the kill: docs/reliability.md.)
        pytest.param(80, "700mbit", id="80MiB"),
    ],
)
def test_leader_killed_mid_version_host_mate_takes_over(tmp_path: Path, size_mb: int, link: str) -> None:
    result = run_scenario(
        "relay_failover.py", str(tmp_path), "3", "2", str(size_mb), link, timeout_s=380
    )
    killed, names, rids = result["killed"], result["names"], result["rids"]
    print(
        json.dumps(
            {k: result[k] for k in ("killed", "leader_after", "reports")}, indent=1
        )
    )
    assert killed["name"] is not None and killed["name"].startswith("h1")
    # Killed while its version was on the wire into host 1.
    assert 0 < killed["rx_bytes"] < size_mb * 2**20
    # Every later version reached every other receiver within timeout_s.
    for report in result["reports"]:
        if report["version"] > result["kill_at"]:
            assert set(report["delivered"]) == set(names) - {killed["name"]}, report
            assert (
                report["latency_s"] is not None
                and report["latency_s"] <= result["timeout_s"]
            )
    # Host 1's other receiver leads it now; no process was restarted.
    (mate,) = [n for n in names if n.startswith("h1") and n != killed["name"]]
    assert result["leader_after"]["rid"] == rids[mate]
    applied = result["applied"]
    assert applied and all(a["exact"] for a in applied), [
        a for a in applied if not a["exact"]
    ]
    last = max(r["version"] for r in result["reports"])
    assert {a["name"] for a in applied if a["version"] == last} == set(names) - {
        killed["name"]
    }


@pytest.mark.timeout(400)
def test_a_middle_leader_killed_mid_version_stalls_nobody_upstream_or_down(tmp_path: Path) -> None:
    """The chain's second leader SIGKILLed mid-version: the first stays first, and the head sends
    it that version to the end rather than leave it half-sent (its receive would then wait out
    ``timeout_s``, and every version with it: a flake hunt at ``-n 2`` saw versions 3 and 5 reach
    nobody within ``timeout_s``). Versions after the kill reach every live receiver, each within
    ``timeout_s``, and well within it."""
    result = run_scenario(
        "relay_failover.py", str(tmp_path), "3", "2", "16", "300mbit", "kill", "chain", "middle", timeout_s=380
    )
    killed, names, rids = result["killed"], result["names"], result["rids"]
    print(json.dumps({k: result[k] for k in ("killed", "leader_after", "reports")}, indent=1))
    host = killed["host"]
    assert killed["name"] is not None and killed["name"].startswith(f"h{host}r")
    assert 0 < killed["rx_bytes"] < 16 * 2**20
    for report in result["reports"]:
        if report["version"] >= result["kill_at"]:
            live = set(names) - {killed["name"]}
            if report["version"] > result["kill_at"]:
                assert set(report["delivered"]) == live, report
            # Not a timeout_s wait anywhere: the kill's own version reaches the hosts around the
            # dead one too (its host-mate once it leads), and every later one, in a few seconds.
            assert set(report["delivered"]) >= live - {n for n in names if n.startswith(f"h{host}r")}, report
            assert report["latency_s"] is not None and report["latency_s"] < result["timeout_s"] / 2, report
    (mate,) = [n for n in names if n.startswith(f"h{host}r") and n != killed["name"]]
    assert result["leader_after"]["rid"] == rids[mate]
    applied = result["applied"]
    assert applied and all(a["exact"] for a in applied), [a for a in applied if not a["exact"]]


@pytest.mark.timeout(400)
def test_leader_stalled_mid_version_is_replaced_and_follows_after_resume(tmp_path: Path) -> None:
    """SIGSTOP, not SIGKILL: the stalled leader's host-mate takes over, the hosts behind are repaired."""
    result = run_scenario(
        "relay_failover.py", str(tmp_path), "3", "2", "16", "300mbit", "stop", timeout_s=380
    )
    stalled, names, rids = result["killed"], result["names"], result["rids"]
    print(json.dumps({k: result[k] for k in ("killed", "leader_after", "reports", "resumed")}, indent=1))
    assert stalled["name"] is not None and stalled["name"].startswith("h1")
    assert 0 < stalled["rx_bytes"] < 16 * 2**20
    for report in result["reports"]:
        if report["version"] > result["kill_at"]:
            assert set(report["delivered"]) >= set(names) - {stalled["name"]}, report
            assert report["latency_s"] is not None and report["latency_s"] <= result["timeout_s"]
    (mate,) = [n for n in names if n.startswith("h1") and n != stalled["name"]]
    assert result["leader_after"]["rid"] == rids[mate]
    # Resumed, it steps down and follows its host-mate: the next version reaches every receiver
    # (the resumed one within the scenario's wait; its push report may close before it is back).
    assert set(result["resumed"]["delivered"]) >= set(names) - {stalled["name"]}, result["resumed"]
    applied = result["applied"]
    assert applied and all(a["exact"] for a in applied), [a for a in applied if not a["exact"]]
    assert {a["name"] for a in applied if a["version"] == result["resumed"]["version"]} == set(names)


def test_a_hop_that_connects_after_a_version_went_by_gets_it_resent(tmp_path: Path) -> None:
    """Every leader connects its hop downstream 1.5 s late and forwards without waiting for
    it: each version still reaches every host bit-exact, with no further push."""
    result = run_scenario("relay_slow_connect.py", str(tmp_path), timeout_s=240)
    applied = {(r["name"], r["version"]): r["exact"] for r in result["applied"]}
    for name in ("h1r0", "h2r0", "h3r0"):
        for version in (1, 2, 3):
            assert applied.get((name, version)) is True, (name, version, result["applied"])
