"""torchrun across simulated hosts: trainer job on one, a two-node rollout job on two others."""

from __future__ import annotations

from pathlib import Path

import pytest
from _netns import run_scenario

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_rollout_job_spans_two_hosts_with_wsync_rendezvous(tmp_path: Path) -> None:
    result = run_scenario("torchrun_across_hosts.py", str(tmp_path), timeout_s=280)
    trainer_addr, *rollout_addrs = result["addresses"]

    starts = result["starts"]
    rollout = [s for s in starts if s["role"] == "rollout"]
    assert len(rollout) == 4 and len([s for s in starts if s["role"] == "trainer"]) == 1
    for s in starts:
        assert s["env"]["WSYNC_STORE"] == f"{trainer_addr}:29400"
        assert s["env"]["WSYNC_JOB"] == "exp1"
    # One elastic group across both hosts: 4 ranks, rank 0's node publishes its own address.
    assert {s["env"]["WSYNC_HOST_ID"] for s in rollout} == {"simh1", "simh2"}
    assert sorted(s["env"]["RANK"] for s in rollout) == ["0", "1", "2", "3"]
    assert {s["env"]["WORLD_SIZE"] for s in rollout} == {"4"}
    assert len({s["env"]["MASTER_ADDR"] for s in rollout}) == 1
    assert rollout[0]["env"]["MASTER_ADDR"] in rollout_addrs
    assert [(p["world_size"], p["allreduce"]) for p in result["pg"]] == [(4, 4.0)] * 4

    # Every version each worker applied is bit-exact; all four end on the trainer's final version.
    applied = result["applied"]
    assert applied and all(a["exact"] for a in applied)
    assert len({a["pid"] for a in applied}) == 4
    (trainer_final,) = [f for f in result["final"] if f["role"] == "trainer"]
    assert trainer_final["version"] > max(result["pushes"])
    assert len(trainer_final["delivered"]) == 4 and trainer_final["failed"] == {}, (
        trainer_final
    )
    finals = [f for f in result["final"] if f["role"] == "rollout"]
    assert len(finals) == 4
    assert all(
        f["exact"] and f["version"] == trainer_final["version"] for f in finals
    ), finals
