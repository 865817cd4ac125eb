"""Helpers for the rendezvous tests: jobs in their own process groups, event logs.

Every process a test starts is a session leader (``start_new_session=True``), so the
torchrun agent and its workers share one process group, killed with ``killpg`` when
the test ends. Scripts report through ``events.jsonl``; tests poll it with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).parent / "scripts"
POLL_S = 0.05

Record = dict[str, Any]


class Job:
    """One process (usually a torchrun agent) started by a test, logging to a file."""

    def __init__(
        self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str]
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115  (closed in kill())
        self.proc = subprocess.Popen(
            list(argv),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still running after {timeout_s} s; log tail:\n{self.tail()}"
            ) from None

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


class Jobs:
    """Starts jobs for one test and kills every one of their process groups after it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[Job] = []

    def env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("WSYNC_", "TORCHELASTIC_"))
        }
        env["PYTHONUNBUFFERED"] = "1"
        env["OMP_NUM_THREADS"] = "1"
        return env

    def start(
        self, name: str, argv: Sequence[str], env: dict[str, str] | None = None
    ) -> Job:
        job = Job(
            name,
            argv,
            self.root / f"{name}.log",
            env if env is not None else self.env(),
        )
        self.started.append(job)
        return job

    def torchrun(
        self,
        name: str,
        *,
        port: int,
        conf: str,
        script: str,
        script_args: Sequence[str] = (),
        nnodes: str = "1",
        nproc: int = 2,
        max_restarts: int = 0,
        rdzv_id: str = "exp1",
        env: dict[str, str] | None = None,
    ) -> Job:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=wsync",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf={conf}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1",
            str(SCRIPTS / script),
            *script_args,
        ]
        return self.start(name, argv, env)

    def describe(self) -> str:
        return "\n".join(
            f"--- {job.name} (rc={job.proc.poll()}):\n{job.tail(25)}"
            for job in self.started
        )

    def kill_all(self) -> None:
        for job in self.started:
            job.kill()


class Events:
    """The JSON-lines event file the launched scripts append to."""

    def __init__(self, path: Path, jobs: Jobs) -> None:
        self.path = path
        self._jobs = jobs

    def read(self) -> list[Record]:
        if not self.path.exists():
            return []
        records = []
        for line in self.path.read_text().splitlines():
            if line.strip():
                records.append(json.loads(line))
        return records

    def select(self, event: str, **match: object) -> list[Record]:
        return [
            r
            for r in self.read()
            if r["event"] == event and all(r.get(k) == v for k, v in match.items())
        ]

    def wait_for(
        self, what: str, predicate: Callable[[list[Record]], Any], timeout_s: float
    ) -> Any:
        """Poll until ``predicate(records)`` is truthy; return its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = predicate(self.read())
            if result:
                return result
            if time.monotonic() > deadline:
                tail = "\n".join(json.dumps(r)[:200] for r in self.read()[-15:])
                raise AssertionError(
                    f"timed out after {timeout_s} s waiting for {what}\nevents tail:\n{tail}\n"
                    f"{self._jobs.describe()}"
                )
            time.sleep(POLL_S)


def wait_until(what: str, condition: Callable[[], Any], timeout_s: float) -> Any:
    """Poll ``condition`` until truthy, with a deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(POLL_S)
