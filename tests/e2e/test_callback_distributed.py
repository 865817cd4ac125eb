"""WeightSyncCallback under 2-rank DDP and FSDP2 (CPU, gloo), Lightning launching the ranks: with
the default (sharded="auto": every rank writes its share) and with sharded=False (rank 0 sends
everything, after a full gather under FSDP2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from _lightning_workers import next_message, receiver_main
from _spawn import CTX

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "_lightning_workers.py"


@pytest.mark.parametrize(("strategy", "sharded"), [("ddp", "auto"), ("ddp", "false"), ("fsdp2", "auto")])
def test_two_ranks_only_rank0_sends_every_version(tmp_path, port, children, strategy, sharded):
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    store = f"127.0.0.1:{port}"
    results = CTX.Queue()
    receiver = CTX.Process(target=receiver_main, args=(store, strategy, "r0", results), daemon=True)
    receiver.start()
    children.track(receiver.pid)
    next_message(results, "ready", timeout_s=60)

    env = {k: v for k, v in os.environ.items() if not k.startswith("WSYNC_")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(SCRIPT), "--strategy", strategy, "--store", store, "--job", strategy,
           "--out", str(tmp_path), "--every", "2", "--max-steps", "5", "--sharded", sharded]  # fmt: skip
    # Its own session, so the rank Lightning starts can be ended with it, by group id.
    trainer = subprocess.Popen(cmd, env=env, cwd=tmp_path, start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    children.track(trainer.pid)
    try:
        output, _ = trainer.communicate(timeout=150)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
    assert trainer.returncode == 0, output[-4000:]

    versions, digests = [], []
    while not versions or versions[-1] < 5:
        msg = next_message(results, "version", timeout_s=30)
        versions.append(msg[2])
        digests.append(msg[3])
    assert next_message(results, "closed", timeout_s=30)[2] == 5
    receiver.join(timeout=30)
    assert receiver.exitcode == 0

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["had_sender"] for r in ranks] == [True, False]
    reason = None if sharded == "auto" else "sharded=False"
    assert [(r["sharded_push"], r["unsharded_reason"]) for r in ranks] == [(sharded == "auto", reason)] * 2
    assert [r["gathers"] for r in ranks] == [0, 0]  # DDP has nothing to gather; FSDP2 by default pushes shards
    assert ranks[0]["versions"] == versions == [0, 2, 4, 5]
    assert ranks[0]["delivered"] == [1, 1, 1, 1]
    assert [r["last_pushed"] for r in ranks] == [5, 5]  # the checkpointed state agrees on every rank
    assert digests[-1] == ranks[0]["digest"]
    if strategy == "ddp":
        assert ranks[1]["digest"] == ranks[0]["digest"]
    del server
