"""Running a multi-host scenario on simulated hosts, from a test.

A scenario is a script under ``tests/multihost/`` that builds its hosts with
:class:`lightning_wsync.testing.hosts.SimHosts` and prints one ``RESULT <json>`` line. It
runs as PID 1 of its own network, mount and PID namespaces (``unshare``; see
``_hosts``): when it ends, or the test kills the ``unshare`` process on timeout, the
kernel kills every process it started and the namespaces, bridge, shared-memory
segments and mounts vanish with it. Nothing outlives the test.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_wsync.testing.hosts import isolated_argv, missing_requirements

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).resolve().parents[1] / "multihost"
_RESULT = "RESULT "


@functools.lru_cache(maxsize=1)
def _unsupported() -> str | None:
    return missing_requirements()


def skip_without_netns() -> None:
    """Skip the calling test when simulated hosts cannot be built here (not root, no ip/tc/unshare)."""
    reason = _unsupported()
    if reason is not None:
        pytest.skip(reason)


def run_scenario(script: str, *args: str, timeout_s: float) -> dict[str, Any]:
    """Run ``tests/multihost/<script>`` in an isolated session; return its RESULT record.

    Fails the test (with the scenario's output) on a non-zero exit, a missing result,
    or ``timeout_s``; on timeout the whole session is killed through its ``unshare``.
    """
    skip_without_netns()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WSYNC_", "TORCHELASTIC_"))
    }
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    # Every Python process of the session (the scenario's trainer, receivers, torchrun's
    # workers: they inherit it) dumps every thread's stack on SIGSEGV, SIGBUS, SIGFPE,
    # SIGABRT or SIGILL, so a native crash leaves its Python frames in the output or log.
    env["PYTHONFAULTHANDLER"] = "1"
    argv = isolated_argv([sys.executable, str(SCENARIOS / script), *args])
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(
            proc.pid, signal.SIGKILL
        )  # unshare --kill-child takes the session's PID 1 with it
        out, _ = proc.communicate(timeout=30)
        pytest.fail(
            f"scenario {script} ran past {timeout_s} s; output tail:\n{_tail(out)}"
        )
    text = out.decode(errors="replace")
    results = [
        line[len(_RESULT) :] for line in text.splitlines() if line.startswith(_RESULT)
    ]
    if proc.returncode != 0 or not results:
        pytest.fail(
            f"scenario {script} exited {_exit(proc.returncode)}; output tail:\n{_tail(out)}"
            f"{_child_logs(args)}"
        )
    result: dict[str, Any] = json.loads(results[-1])
    result["_output"] = text
    return result


def _exit(code: int) -> str:
    """``-11`` as ``-11 (SIGSEGV)``: a negative exit status is the signal that ended the process."""
    if code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)


def _child_logs(args: tuple[str, ...], lines: int = 40) -> str:
    """The tail of each ``*.log`` the scenario's processes wrote under its output folder
    (the first argument, by convention): a child's own crash report (faulthandler's
    stacks) is there, not in the scenario's output."""
    if not args or not Path(args[0]).is_dir():
        return ""
    parts = [
        f"\n--- {log.name}:\n" + _tail(log.read_bytes(), lines)
        for log in sorted(Path(args[0]).glob("*.log"))
    ]
    return "".join(parts)


def _tail(out: bytes, lines: int = 80) -> str:
    return "\n".join(out.decode(errors="replace").splitlines()[-lines:])
