"""The LLM demo command, end to end: a vLLM engine fed by a Lightning trainer reaches its reward target."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip(
    "vllm", reason="vLLM not installed: pip install 'lightning-wsync[vllm]' (bash .ci/run tests it in .venv-vllm)"
)
from _vllm_only import PROCESSES  # noqa: E402  (after the skip)


@pytest.mark.slow
@pytest.mark.timeout(900)
@PROCESSES
@pytest.mark.parametrize("flags", [[], ["--async"]], ids=["llm", "async-llm"])
def test_llm_demo_reaches_the_reward_target(tmp_path, flags):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSYNC_") and k != "RANK"}
    env.update(WSYNC_DEMO_OUT=str(tmp_path), WSYNC_VLLM_VENV=str(Path(sys.executable).parent.parent))
    proc = subprocess.Popen(["bash", "examples/llm_vllm/run_demo.sh", *flags], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=840)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["solved"] and summary["final_mean_reward"] >= 0.95
    rollouts = [json.loads(line) for line in (tmp_path / "rollout.jsonl").read_text().splitlines()]
    first = [r["reward"] for r in rollouts if r["version"] == 0]
    assert first and sum(first) / len(first) < 0.4  # the rise is the trainer's doing, seen in the engine
    assert max(r["engine_version"] for r in rollouts) >= summary["versions"] - 2  # the engine followed the pushes
    assert "== SOLVED" in out
    assert " over 0 updates" not in out  # the summary counts the engine's updates, --async too
    assert (tmp_path / "reward.png").stat().st_size > 10_000
    for log in ("trainer.log", "rollout.log"):
        assert "Traceback" not in (tmp_path / log).read_text(), log
