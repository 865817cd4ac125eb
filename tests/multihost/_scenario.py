"""Shared by the scenario scripts: session set-up, processes on hosts, the result line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _relaylog import relay_info

from lightning_wsync._control import keys
from lightning_wsync.testing.hosts import SimHosts, prepare_session

POLL_S = 0.05
_DUMPABLE = ("_relay_receiver.py", "_shard_rank.py")  # scripts that call relay_info()
# Signals a process gets from its own fault (the kernel or abort()), never from a scenario.
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE, signal.SIGILL})


class Procs:
    """Processes started on simulated hosts, each logging to its own file."""

    def __init__(self, hosts: SimHosts, root: Path) -> None:
        self.hosts = hosts
        self.root = root
        self.started: dict[str, subprocess.Popen[bytes]] = {}
        self._dumpable: set[str] = set()  # children that write their stacks on SIGUSR1 (relay_info())

    def start(
        self,
        name: str,
        host: int,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - the child holds it
        proc = self.hosts.popen(
            host,
            argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        self.started[name] = proc
        if any(Path(a).name in _DUMPABLE for a in argv[1:2]):
            self._dumpable.add(name)
        return proc

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.root / f"{name}.log"
        return (
            "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            if path.exists()
            else ""
        )

    def describe(self) -> str:
        return "\n".join(
            f"--- {n} (rc={_status(p.poll())}):\n{self.tail(n)}" for n, p in self.started.items()
        )

    def crashed(self) -> dict[str, str]:
        """Each process that has ended by a crash signal, with its log's tail (faulthandler's stacks)."""
        return {
            n: f"rc={_status(rc)}\n{self.tail(n, 60)}"
            for n, p in self.started.items()
            if (rc := p.poll()) is not None and rc < 0 and -rc in CRASH_SIGNALS
        }

    def dump_stacks(self, settle_s: float = 1.0) -> None:
        """Have every live child that registered faulthandler on SIGUSR1 (``_relay_receiver.py``)
        write each thread's stack to its log: where a process that made no progress was."""
        for name in self._dumpable:
            if (p := self.started[name]).poll() is None:
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(settle_s)  # the dumps are written by each child's own faulthandler thread; a failure path only

    def wait(self, name: str, timeout_s: float) -> int:
        try:
            return self.started[name].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{name} still running after {timeout_s} s\n{self.describe()}"
            ) from None


def _status(rc: int | None) -> str:
    if rc is None or rc >= 0:
        return str(rc)
    try:
        return f"{rc} ({signal.Signals(-rc).name})"
    except ValueError:
        return str(rc)


def wait_until(
    what: str,
    condition: Callable[[], Any],
    timeout_s: float,
    procs: Procs | None = None,
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            if procs:
                procs.dump_stacks()
            raise AssertionError(
                f"timed out after {timeout_s} s waiting for {what}\n{procs.describe() if procs else ''}"
            )
        time.sleep(POLL_S)


def leader_receipts(ctl: Any, epoch: int, rids: dict[str, int | None], version: int,
                    timeout_s: float = 10.0) -> dict[str, Any]:  # fmt: skip
    """name -> its host leader's receipt of ``version`` (``relay/<epoch>/received/<rid>``), for each
    of ``rids`` (name -> leader rid, None: no leader, skipped) whose leader has one within ``timeout_s``.

    Waited for, not read once: a leader writes its receipt before it publishes the version on its
    host, but a TCPStore ``set`` has no reply, and it travels on the host's shaped link behind the
    version the leader forwards, so it can land after the receivers' ``applied`` events that a
    scenario reads from a file (seen: a restarted host's receipt absent 25 ms after it applied).
    """
    deadline = time.monotonic() + timeout_s
    led = {name: rid for name, rid in rids.items() if rid is not None}
    while True:
        got: dict[str, Any] = {}
        for name, rid in led.items():
            note = ctl.get_json(keys.relay_received(epoch, rid))
            if note is not None and str(version) in note:
                got[name] = note[str(version)]
        if len(got) == len(led) or time.monotonic() > deadline:
            return got
        time.sleep(POLL_S)


def main(scenario: Callable[[list[str]], dict[str, Any]]) -> None:
    """Run ``scenario(argv)`` as the session's PID 1 and print its ``RESULT`` line."""
    relay_info()
    try:
        prepare_session()
        result = scenario(sys.argv[1:])
    except BaseException:  # noqa: BLE001 - reported to the test through the exit status
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # PID 1 exiting takes every process of the session with it
