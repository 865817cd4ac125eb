"""Pushes faster than copies: after every update() the module holds exactly the version it names.

Each version fills every tensor with its own number, so a mix of two versions, or a
module that holds another version than ``receiver.version`` says, is visible at once.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _spawn import CTX
from torch import nn

from lightning_wsync import WeightReceiver, WeightSender
from lightning_wsync._pull import receiver as receiver_module
from lightning_wsync._pull.watcher import Watcher

PUSHES = 300
_SIDE = 512  # 4 tensors of 512x512 fp32: 4 MiB, a copy of about a millisecond


def flat_model() -> nn.Module:
    return nn.ParameterList([nn.Parameter(torch.zeros(_SIDE, _SIDE)) for _ in range(4)])


def fill(module: nn.Module, value: float) -> None:
    with torch.no_grad():
        for t in module.parameters():
            t.fill_(value)


def held_values(module: nn.Module) -> set[float]:
    """The distinct values across the module: one when it holds one version."""
    return {float(v) for t in module.parameters() for v in (t.detach().min(), t.detach().max())}


class TimedWatcher(Watcher):
    """Notes when each version finished arriving over its network link."""

    staged_at: list[tuple[float, int]] = []

    def _on_staged(self, version: int) -> None:
        self.staged_at.append((time.monotonic(), version))
        super()._on_staged(version)


class TimedReceiver(WeightReceiver):
    """A receiver whose watcher notes staging times (in the child process only)."""

    staged_at = TimedWatcher.staged_at

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        receiver_module.Watcher = TimedWatcher  # type: ignore[misc]
        super().__init__(*args, **kwargs)


def stress_receiver(
    store: str, job: str, options: dict[str, Any], stop: Any, results: Any, final: int | None = PUSHES + 2,
    started: Any = None,
) -> None:
    torch.set_num_threads(1)
    module = flat_model()
    fill(module, -1.0)
    mixes, checks, applies = 0, 0, []
    seen: list[Any] = []
    TimedWatcher.staged_at.clear()
    with TimedReceiver(module, store=store, job=job, timeout_s=20, **options) as receiver:
        receiver.wait_for_version(0, timeout_s=60)
        if started is not None:
            started.put(os.getpid())
        while not stop.is_set() or receiver.update() is not None:
            got = receiver.update()
            checks += 1
            values = held_values(module)
            if values != {float(receiver.version)}:
                mixes += 1
                seen.append((sorted(values)[:6], receiver.version, got))
            if got is not None:
                applies.append((time.monotonic(), got))
        held = receiver.wait_for_version(final, timeout_s=30) if final is not None else receiver.version
        ok_final = held_values(module) == {float(held)}
    results.put({"mixes": mixes, "checks": checks, "applies": applies, "final": held, "ok_final": ok_final,
                 "staged": TimedReceiver.staged_at, "seen": seen[:5]})


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        ("auto", {}),
        ("auto", {"verify": True}),
        ("gloo", {"apply": "copy"}),
        ("gloo", {"apply": "swap"}),
    ],
    ids=["shm", "shm-verify", "gloo-copy", "gloo-swap"],
)
@pytest.mark.timeout(240)
def test_back_to_back_pushes_never_mix_versions(children, port, mode):
    transport, options = mode
    store = f"127.0.0.1:{port}"
    job = f"stress-{transport}-{'-'.join(f'{k}{v}' for k, v in options.items())}"
    ctx = CTX
    results, stop = ctx.Queue(), ctx.Event()
    model = flat_model()
    with WeightSender(model, store=store, job=job, transport=transport, timeout_s=20) as sender:
        fill(model, 0.0)
        sender.push(0)
        procs = [ctx.Process(target=stress_receiver, args=(store, job, options, stop, results)) for _ in range(2)]
        for p in procs:
            p.start()
            children.track(p.pid)
        deadline = time.monotonic() + 90
        while len(sender.receivers()) < 2:
            assert time.monotonic() < deadline, "receivers did not join"
            time.sleep(0.01)
        fill(model, 1.0)
        assert sender.push(1, wait_for_slot_s=20).wait(30).delivered  # everyone is following
        rng = random.Random(0)
        started = time.monotonic()
        for version in range(2, PUSHES + 2):
            fill(model, float(version))
            sender.push(version)
            time.sleep(rng.choice([0.0, 0.0, 0.0005, 0.001, 0.003, 0.01]))  # pacing, not synchronisation
        storm_s = time.monotonic() - started
        last = PUSHES + 2
        fill(model, float(last))
        report = sender.push(last, wait_for_slot_s=20).wait(30)
        stop.set()
        outcomes = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        dropped = sender.dropped_pushes
    assert sorted(report.delivered) and not report.failed, report
    for out in outcomes:
        assert out["mixes"] == 0, (
            f"{out['mixes']} of {out['checks']} checks saw a module unlike its version: {out['seen']}"
        )
        assert out["final"] == last and out["ok_final"]
        versions = [v for _, v in out["applies"]]
        assert versions == sorted(versions) and len(set(versions)) == len(versions)
        storm = [t for t, v in out["applies"] if 2 <= v <= PUSHES + 1]
        assert len(storm) >= 3, f"only {len(storm)} versions applied during {storm_s:.2f} s of pushes"
        if transport == "gloo":
            # Latest-complete, like a video stream dropping frames: while pushes come faster
            # than a send, a new version is applied at least every two send times (one send
            # time: how often this receiver's link completes a version under this load).
            staged = [t for t, v in out["staged"] if 2 <= v <= PUSHES + 1]
            send_s = statistics.median(b - a for a, b in zip(staged, staged[1:]))
            gaps = [b - a for a, b in zip(storm, storm[1:])]
            assert len(storm) >= 10 and statistics.median(gaps) <= 2 * send_s, (len(storm), gaps, send_s)
            assert max(gaps) <= 2 * max(b - a for a, b in zip(staged, staged[1:])), (gaps, staged)
    print(f"{mode}: {storm_s:.2f} s of pushes, {dropped} dropped; applied "
          f"{[len(o['applies']) for o in outcomes]} versions; {[o['checks'] for o in outcomes]} checks")


_KILLED_SENDER = textwrap.dedent(
    """
    import os, sys, torch
    from torch import nn
    sys.path[:0] = [{tests!r}, {support!r}]
    from test_immutable_versions import fill, flat_model
    from lightning_wsync import WeightSender
    model = flat_model()
    sender = WeightSender(model, store={store!r}, job={job!r}, timeout_s=20)
    version = {first}
    print("ready", sender.epoch, flush=True)
    while True:  # pushes until SIGKILLed, most likely inside a snapshot copy
        fill(model, float(version))
        sender.push(version)
        version += 1
    """
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_trainer_killed_inside_a_snapshot_write(children, port, tmp_path):
    store = f"127.0.0.1:{port}"
    job = "killed-mid-snapshot"
    tests = str(Path(__file__).resolve().parent)
    support = str(Path(__file__).resolve().parents[1] / "support")  # _spawn, imported by this module
    host = WeightSender(nn.Linear(1, 1), store=store, job="store-host")  # keeps the store up across trainers
    ctx = CTX
    results, stop, started = ctx.Queue(), ctx.Event(), ctx.Queue()
    try:
        first = subprocess.Popen([sys.executable, "-c", _KILLED_SENDER.format(tests=tests, support=support, store=store,
                                 job=job, first=0)], stdout=subprocess.PIPE, text=True)  # fmt: skip
        children.track(first.pid)
        assert first.stdout is not None and first.stdout.readline().startswith("ready")
        restart = 10**5  # the restarted trainer's first version
        procs = [ctx.Process(target=stress_receiver, args=(store, job, {}, stop, results, restart, started))
                 for _ in range(2)]  # fmt: skip
        for p in procs:
            p.start()
            children.track(p.pid)
        for _ in procs:
            started.get(timeout=90)  # both follow the first trainer
        rng = random.Random(1)
        probe_module = flat_model()
        with WeightReceiver(probe_module, store=store, job=job, name="watch") as probe:
            probe.wait_for_version(0, timeout_s=60)
            segment = probe._watcher.source._reader._segment  # type: ignore[union-attr]
            # SIGKILL while a slot is being written: poll the header for an odd sequence.
            deadline = time.monotonic() + 60
            while True:
                assert time.monotonic() < deadline, "never caught the sender inside a write"
                if any(segment.seq(s) % 2 for s in range(segment.slots)):
                    os.kill(first.pid, signal.SIGKILL)
                    break
                time.sleep(rng.random() * 0.001)
            first.wait(10)
            old_path = segment.path
            assert any(segment.seq(s) % 2 for s in range(segment.slots)), "the kill did not land inside a write"
            # Receivers keep their version; update() neither blocks nor raises.
            started = time.monotonic()
            before = probe.version
            assert probe.update() in (None, probe.version) and time.monotonic() - started < 1.0
            assert before is not None and held_values(probe_module) == {float(probe.version)}
            # A restarted trainer: its versions reach every receiver at once.
            code = _KILLED_SENDER.format(tests=tests, support=support, store=store, job=job, first=restart)
            second = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)  # fmt: skip
            children.track(second.pid)
            assert second.stdout is not None and second.stdout.readline().startswith("ready")
            assert probe.wait_for_version(restart, timeout_s=20) >= restart
            assert not os.path.exists(old_path), "the killed sender's segment was not reclaimed"
            # The stress receivers too (each waits for the restart's versions before it reports,
            # while the second trainer still pushes: a loaded machine may take them a while).
            stop.set()
            outcomes = [results.get(timeout=60) for _ in procs]
            second.kill()
            second.wait(10)
    finally:
        stop.set()
        host.close(flush_timeout_s=0)
    for out in outcomes:
        assert out["mixes"] == 0, out
        assert out["ok_final"] and out["final"] >= restart, out
