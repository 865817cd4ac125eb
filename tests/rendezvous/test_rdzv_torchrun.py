"""Real torchrun jobs on 127.0.0.1 with ``--rdzv-backend=wsync``.

Scripts under ``scripts/`` report through ``events.jsonl``; every wait polls it with a
deadline, and every job's process group is killed when the test ends.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ._rdzv_helpers import Events, Job, Jobs, Record, wait_until

pytestmark = pytest.mark.slow


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _tracebacks(log: str) -> list[str]:
    """Python tracebacks and the C++ stack dumps torch prints for a failed store call."""
    return [
        line
        for line in log.splitlines()
        if line.startswith(("Traceback", "Exception raised from"))
    ]


def _latest_push(records: list[Record]) -> int:
    return max(r["version"] for r in records if r["event"] == "push")


@pytest.mark.timeout(240)
def test_trainer_and_rollout_jobs_share_a_rendezvous(
    jobs: Jobs, events: Events, port: int
) -> None:
    out = str(jobs.root)
    stop = jobs.root / "stop-trainer"
    trainer = jobs.torchrun(
        "trainer",
        port=port,
        conf="role=trainer",
        script="trainer_job.py",
        script_args=["--out", out, "--stop", str(stop)],
    )
    rollout_a = jobs.torchrun(
        "rollout-a",
        port=port,
        conf="role=rollout",
        nnodes="1:3",
        max_restarts=3,
        script="rollout_job.py",
        script_args=["--out", out, "--tag", "A", "--pg"],
    )

    # Both rollout workers hold a pushed version (bit-exact: checked at the end).
    events.wait_for(
        "both rollout-A workers to apply a version",
        lambda rs: len({r["pid"] for r in rs if r["event"] == "applied"}) == 2,
        timeout_s=90,
    )
    for start in events.select("start"):
        env = start["env"]
        assert env["WSYNC_STORE"] == f"127.0.0.1:{port}"
        assert env["WSYNC_JOB"] == "exp1"
        assert env["WSYNC_ROLE"] == start["role"]
        assert env["WORLD_SIZE"] == "2"
    trainer_port = {
        s["env"]["MASTER_PORT"] for s in events.select("start", role="trainer")
    }
    rollout_port = {
        s["env"]["MASTER_PORT"] for s in events.select("start", role="rollout")
    }
    assert (
        len(trainer_port) == 1
        and len(rollout_port) == 1
        and trainer_port != rollout_port
    )

    # A second rollout agent with the same id joins mid-run: the rollout group grows to
    # 4 workers, all of which get the newest version while the trainer pushes on.
    joined_at = len(events.read())
    version_at_join = _latest_push(events.read())
    rollout_b = jobs.torchrun(
        "rollout-b",
        port=port,
        conf="role=rollout",
        nnodes="1:3",
        max_restarts=3,
        script="rollout_job.py",
        script_args=["--out", out, "--tag", "B", "--pg"],
    )

    def new_group_holding(rs: list[Record], after: int, version: int) -> bool:
        """Whether 4 workers started after record ``after`` all hold ``version`` or newer."""
        started = {
            r["pid"]
            for r in rs[after:]
            if r["event"] == "start" and r["role"] == "rollout"
        }
        holding = {
            r["pid"] for r in rs if r["event"] == "applied" and r["version"] >= version
        }
        return len(started) == 4 and started <= holding

    events.wait_for(
        "4 rollout workers (A and B) to hold the newest version",
        lambda rs: new_group_holding(rs, joined_at, version_at_join),
        timeout_s=90,
    )
    assert _latest_push(events.read()) > version_at_join
    assert {
        r["env"]["WORLD_SIZE"]
        for r in events.read()[joined_at:]
        if r["event"] == "start"
    } == {"4"}

    # SIGKILL one rollout worker: its agent restarts its workers and the group of 4
    # re-forms (a fresh gloo group over a fresh MASTER_PORT); all of them hold the
    # newest version again, while the trainer never notices.
    victim = [
        r for r in events.select("start", tag="A") if r["env"]["WORLD_SIZE"] == "4"
    ][-1]["pid"]
    version_at_kill = _latest_push(events.read())
    killed_record = len(events.read())
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    events.wait_for(
        "the re-formed group of 4 to hold the version pushed at the kill",
        lambda rs: new_group_holding(rs, killed_record, version_at_kill),
        timeout_s=90,
    )
    recovery_s = time.monotonic() - killed_at
    print(
        f"rollout workers held version >= {version_at_kill} again {recovery_s:.1f} s after SIGKILL"
    )
    assert recovery_s < 60
    assert _latest_push(events.read()) > version_at_kill
    regroup = [r for r in events.read()[killed_record:] if r["event"] == "start"]
    assert {(r["tag"], r["restart"], r["env"]["WORLD_SIZE"]) for r in regroup} == {
        ("A", "1", "4"),  # restarted by its agent after the failure (counts as a retry)
        ("B", "0", "4"),  # restarted for the membership change (does not)
    }

    # The trainer finishes: every rollout worker applies the final version and both
    # rollout jobs end cleanly (the trainer's agent keeps its store up until they do).
    stop.touch()
    assert trainer.wait(timeout_s=60) == 0
    assert rollout_a.wait(timeout_s=60) == 0, rollout_a.tail()
    assert rollout_b.wait(timeout_s=60) == 0, rollout_b.tail()
    (final,) = events.select("final", role="trainer")
    finals = events.select("final", role="rollout")
    assert len(finals) == 4
    assert {(r["tag"], r["version"], r["exact"]) for r in finals} == {
        ("A", final["version"], True),
        ("B", final["version"], True),
    }
    assert final["failed"] == {}
    assert all(r["exact"] for r in events.select("applied"))

    # Every rollout worker generation (first start, after the join, after the kill)
    # formed its gloo group over MASTER_ADDR/MASTER_PORT before receiving weights.
    groups = {r["pid"]: r for r in events.select("pg", role="rollout")}
    assert {r["pid"] for r in events.select("applied")} <= set(groups)
    assert all(g["allreduce"] == g["world_size"] for g in groups.values())
    assert [g["world_size"] for g in groups.values()].count(4) >= 8

    trainer_starts = events.select("start", role="trainer")
    assert len(trainer_starts) == 2
    assert {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in trainer_starts} == {"0"}
    assert {
        r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in events.select("start", tag="B")
    } == {"0"}
    for job in (trainer, rollout_a, rollout_b):
        assert not _tracebacks(job.log()), job.tail()
    assert not _pid_alive(victim)


@pytest.mark.timeout(240)
def test_standalone_store_lets_jobs_outlive_each_other(
    jobs: Jobs, events: Events
) -> None:
    store_job = jobs.start(
        "store",
        [
            sys.executable,
            "-m",
            "lightning_wsync.cli",
            "store",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ],
    )
    line = wait_until(
        "the store to print its port",
        lambda: next(
            (ln for ln in store_job.log().splitlines() if "listening on" in ln), None
        ),
        timeout_s=60,
    )
    port = int(line.rsplit(":", 1)[1])
    client = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)
    )
    out = str(jobs.root)

    def probe(name: str, conf: str, *extra: str) -> object:
        return jobs.torchrun(
            name,
            port=port,
            conf=conf,
            nproc=1,
            nnodes="1:2" if "rollout" in conf else "1",
            script="probe_worker.py",
            script_args=["--out", out, "--store-check", "--tag", name, *extra],
        )

    t1 = probe("t1", "role=trainer,is_host=false", "--hold", str(jobs.root / "stop-t1"))
    r1 = probe("r1", "role=rollout", "--hold", str(jobs.root / "stop-r1"))
    events.wait_for(
        "t1 and r1 to read the store",
        lambda rs: len([r for r in rs if r["event"] == "store"]) == 2,
        90,
    )
    (t1_value,) = {r["value"] for r in events.select("store")}

    # The trainer job ends; the rollout job keeps running on the standalone store.
    (jobs.root / "stop-t1").touch()
    assert t1.wait(timeout_s=60) == 0
    assert r1.running()
    assert events.select("exit", tag="r1") == []

    # A new trainer job with the same id forms a fresh trainer rendezvous (launch 1).
    t2 = probe("t2", "role=trainer,is_host=false", "--hold", str(jobs.root / "stop-t2"))
    events.wait_for(
        "t2 to read the store",
        lambda rs: any(r["event"] == "store" and r["tag"] == "t2" for r in rs),
        90,
    )
    assert client.get("wsync.rdzv/exp1/trainer/launch") == b"1"
    (t2_value,) = {r["value"] for r in events.select("store", tag="t2")}
    assert t2_value != t1_value and t2_value.startswith("hello from trainer pid")

    # The rollout job ends and is relaunched with the same id: launch 1 for the rollout.
    (jobs.root / "stop-r1").touch()
    assert r1.wait(timeout_s=60) == 0
    r2 = probe("r2", "role=rollout")
    assert r2.wait(timeout_s=90) == 0
    assert client.get("wsync.rdzv/exp1/rollout/launch") == b"1"
    assert [r["value"] for r in events.select("store", tag="r2")] == [t2_value]

    (jobs.root / "stop-t2").touch()
    assert t2.wait(timeout_s=60) == 0
    for job in (t1, r1, t2, r2):
        assert not _tracebacks(job.log()), job.tail()

    del client
    os.kill(store_job.pid, signal.SIGTERM)
    assert store_job.wait(timeout_s=30) == 0
    assert store_job.log().splitlines()[-1] == "lightning-wsync store: stopping"


@pytest.mark.timeout(180)
def test_rollout_job_outlives_the_trainer_that_hosted_its_store(
    jobs: Jobs, events: Events, port: int
) -> None:
    out = str(jobs.root)

    def probe(name: str, conf: str) -> Job:
        return jobs.torchrun(
            name,
            port=port,
            conf=conf,
            nproc=1,
            nnodes="1:2" if "rollout" in conf else "1",
            script="probe_worker.py",
            script_args=[
                "--out",
                out,
                "--store-check",
                "--tag",
                name,
                "--hold",
                str(jobs.root / f"stop-{name}"),
            ],
        )

    trainer = probe("trainer", "role=trainer,linger_timeout=3")
    rollout = probe("rollout", "role=rollout")
    events.wait_for(
        "both jobs to read the store",
        lambda rs: len([r for r in rs if r["event"] == "store"]) == 2,
        90,
    )
    (jobs.root / "stop-trainer").touch()
    events.wait_for(
        "the trainer worker to exit",
        lambda rs: any(r["event"] == "exit" for r in rs),
        60,
    )
    worker_done = time.monotonic()
    assert trainer.wait(timeout_s=60) == 0
    # Its agent kept the store up for the rollout agent, which still uses it, until
    # linger_timeout ran out.
    assert time.monotonic() - worker_done >= 2.5
    assert "closing the store at" in trainer.log()

    # The rollout agent notices the store is gone while its worker still runs, and
    # keeps monitoring it instead of crashing in num_nodes_waiting().
    wait_until(
        "the rollout agent to notice the store is gone",
        lambda: f"control-plane store at 127.0.0.1:{port} is gone" in rollout.log(),
        timeout_s=30,
    )
    assert rollout.running()
    assert events.select("exit", tag="rollout") == []

    (jobs.root / "stop-rollout").touch()
    assert rollout.wait(timeout_s=60) == 0
    log = rollout.log()
    assert not _tracebacks(log), rollout.tail()
    assert log.count("failed to send a keep-alive heartbeat") <= 1, rollout.tail()
    assert [r["tag"] for r in events.select("exit")] == ["trainer", "rollout"]
