"""A receiver of a sharded sender that cannot map its host's ring of a stream (its own /dev/shm, as a
container on the host network sharing the host id) gets that stream over the network into a ring of its
own, standing alone in it (lightning_wsync/_planes/relay/alone.py), and says so once.

Trainer ranks 0 and 1 on host ids trainer-a and trainer-b (this process); receiver A on rollout-1 (this
process, the leader of both streams there); in a process with a /dev/shm of its own: receiver B on rollout-1
(cannot map A's rings) and receiver C on trainer-a (cannot map rank 0's own ring). Every one applies every
version bit-exact, verifying every share.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _sharded import sharded_model, zeroed_sharded_model

from lightning_wsync import SenderConfig, WeightReceiver, WeightSender
from lightning_wsync._control import keys
from lightning_wsync._control.records import StreamLeadersRecord
from lightning_wsync._planes.shares import ShareWriter
from lightning_wsync._push.shares import prepare_shares
from lightning_wsync.testing.models import digest, mutate

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare (CI: root)"),
]
TESTS = Path(__file__).resolve().parents[1] / "support"
OWN_DEV_SHM = ["unshare", "--mount", "--propagation", "private", "--kill-child", "--", "sh", "-c",
               'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"']  # fmt: skip


class Lines:
    """A process's output, line by line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.out, self._lines = proc, [], queue.Queue()
        assert proc.stdout is not None
        self._reader = threading.Thread(target=lambda: [self._lines.put(x) for x in proc.stdout], daemon=True)
        self._reader.start()

    def next(self, prefix: str, timeout_s: float = 240) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line; the receivers printed:\n{''.join(self.out)}") from None
            self.out.append(line)
            if line.startswith(prefix):
                return line

    def rest(self) -> str:
        self._reader.join(timeout=10)
        while not self._lines.empty():
            self.out.append(self._lines.get())
        return "".join(self.out)


def _wait_for_nixl_hops(sender: WeightSender, counts: list[int], timeout_s: float = 60) -> None:
    """Until ``counts[r]`` receivers stand alone in rank r's stream, each with its NIXL hop's agent
    on the store (``nixl/<stream>/agent/h<rid>``: it READs that stream from upstream)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = []
        for rank in range(len(counts)):
            stream = keys.relay_stream(sender.epoch, rank)
            record = sender._ctl.get_record(keys.relay_stream_alone(stream), StreamLeadersRecord)
            rids = [] if record is None else sorted(record.leaders)
            seen.append([rid for rid in rids if sender._ctl.has(keys.nixl_agent(stream, f"h{rid}"))])
        if [len(s) for s in seen] == counts:
            return
        assert time.monotonic() < deadline, f"alone receivers with NIXL hops, by stream: {seen}, wanted {counts}"
        time.sleep(0.05)


def _nixl_unusable() -> str | None:
    from lightning_wsync._planes.nixl.agent import unusable

    return unusable()


@pytest.mark.parametrize("transport", [
    "auto",  # gloo hops
    pytest.param("nixl", marks=pytest.mark.skipif(_nixl_unusable() is not None, reason=f"{_nixl_unusable()}")),
])  # fmt: skip
def test_receivers_that_cannot_map_a_streams_ring_get_it_over_the_network_alone(
    server, port, monkeypatch, children, transport
) -> None:
    """``nixl``: each stream's hops are NIXL READs (docs/nixl.md), the alone receivers' included,
    from a /dev/shm of their own, as a container on the host network would READ."""
    monkeypatch.setenv("WSYNC_HOST_ID", "trainer-a")
    address, last = f"127.0.0.1:{port}", 4
    model = sharded_model()
    cfg = SenderConfig(job="alone", timeout_s=10, heartbeat_timeout_s=10, transport=transport)
    mine = prepare_shares(model, cfg, 0, 2)
    theirs = dataclasses.replace(prepare_shares(model, cfg, 1, 2), host="trainer-b")
    writer = ShareWriter(theirs, cfg)
    plan = mine.plan.with_segments(["", writer.name], ["trainer-a", "trainer-b"])
    proc = None
    try:
        with WeightSender(model, store=address, config=cfg, shares=dataclasses.replace(mine, plan=plan)) as sender:
            writer.relay(address, sender.epoch, cfg)
            monkeypatch.setenv("WSYNC_HOST_ID", "rollout-1")
            module = zeroed_sharded_model()
            with WeightReceiver(module, store=address, job="alone", name="a", timeout_s=10, verify=True) as a:
                monkeypatch.setenv("WSYNC_HOST_ID", "trainer-a")
                mutate(model, 1)
                assert writer.write(1)
                sender.push(1)
                expected = {1: digest(model, None)}
                assert a.wait_for_version(1, timeout_s=60) == 1  # A leads rollout-1 in both streams by now
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
                env.pop("WSYNC_HOST_ID")
                proc = subprocess.Popen([*OWN_DEV_SHM, sys.executable, str(TESTS / "_alone_receivers.py"), address,
                                         "alone", str(last), "rollout-1", "trainer-a"], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
                children.track(proc.pid)
                lines = Lines(proc)
                lines.next("READY")
                got: dict[str, dict[int, tuple[str, str]]] = {"alone-rollout-1": {}, "alone-trainer-a": {}}
                version = 1
                while any(last not in seen for seen in got.values()):
                    if version < last:
                        if transport == "nixl" and version + 1 == last:  # the alone leaders live till then
                            _wait_for_nixl_hops(sender, [2, 1])
                        version += 1
                        mutate(model, version)
                        assert writer.write(version)
                        report = sender.push(version).wait(timeout_s=60)
                        assert "a" in report.delivered, report
                        assert a.wait_for_version(version, timeout_s=60) == version
                        expected[version] = digest(model, None)
                        assert digest(module, None) == expected[version]
                    line = lines.next("VERSION").split(maxsplit=4)
                    got[line[1]][int(line[2])] = (line[3], line[4].strip())
                for name, seen in got.items():  # every version each applied is the trainer's, bit-exact
                    assert all(d == expected[v] for v, (d, _) in seen.items()), (name, seen, expected)
                    assert seen[last][1] == "relay across hosts, sharded over 2 trainer ranks (2 streams relayed)"
                alone = [sender._ctl.get_record(keys.relay_stream_alone(keys.relay_stream(sender.epoch, r)),
                                                StreamLeadersRecord) for r in (0, 1)]  # fmt: skip
                stood = [sorted(h for h in rec.leaders.values()) if rec is not None else [] for rec in alone]
                assert [[h.split("/alone-")[0] for h in hs] for hs in stood] == [["rollout-1", "trainer-a"],
                                                                               ["rollout-1"]], stood
                assert proc.wait(timeout=60) == 0, lines.rest()
    finally:
        writer.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
    text = lines.rest()
    said_c = [x for x in text.splitlines() if "cannot map this host's ring of trainer rank 0's share" in x]
    assert len(said_c) == 1 and "'alone-trainer-a'" in said_c[0], text  # C says so once, for rank 0's ring
    said_b = [x for x in text.splitlines() if "cannot open its leader's" in x]
    assert len(said_b) == 2, text  # B's member of each stream (rollout-1's rings are A's), once each
