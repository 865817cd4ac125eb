"""The trainer process is SIGKILLed and restarted by torchrun from its last checkpoint:
receivers keep their version meanwhile and afterwards receive only higher versions."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from lightning_wsync import WeightReceiver, WeightSyncClosedError, WeightSyncTimeoutError
from lightning_wsync.testing.models import digest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_trainer_restart_from_checkpoint(tmp_path, port, jobs, events):
    trainer = jobs.torchrun(
        "trainer", port=port, conf="role=trainer", script="lightning_trainer_job.py", nproc=1,
        max_restarts=1, rdzv_id="restart", script_args=["--out", str(tmp_path), "--max-steps", "60"],
    )  # fmt: skip
    first = events.wait_for("the trainer's start", lambda r: [e for e in r if e["event"] == "start"], 120)[0]
    policy = torch.nn.Linear(4, 2)
    applied: list[int] = []
    killed_at: int | None = None
    with WeightReceiver(policy, store=f"127.0.0.1:{port}", job="restart", timeout_s=30) as receiver:
        deadline = time.monotonic() + 240
        while not events.select("done") or receiver.version != events.select("done")[0]["step"]:
            assert time.monotonic() < deadline, jobs.describe()
            try:
                applied.append(receiver.wait_for_version(applied[-1] + 1 if applied else 0, timeout_s=1))
            except (WeightSyncTimeoutError, WeightSyncClosedError):
                continue  # between trainer incarnations, or after the last push
            if killed_at is None and applied[-1] >= 20 and (tmp_path / "ckpt" / "last.ckpt").exists():
                os.kill(first["pid"], signal.SIGKILL)
                killed_at = receiver.version
                # Meanwhile the receiver keeps serving what it holds.
                assert receiver.update() is None and receiver.version == killed_at
    assert trainer.wait(timeout_s=120) == 0, jobs.describe()
    done = events.select("done")[0]
    starts = events.select("start")
    assert killed_at is not None and len(starts) == 2
    assert starts[1]["restart"] == "1" and starts[1]["resume"] is not None
    assert applied == sorted(set(applied)), applied  # only ever higher versions
    assert applied[-1] == done["step"] == 60
    assert digest(policy) == done["digest"]
