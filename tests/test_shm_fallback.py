"""Same host by host id, but the sender's segment cannot be opened here: with
transport='auto' the receiver takes the network path, saying so in one log line.

Each receiver is a real process, cut off from the segment the way production meets it:
its own /dev/shm (a container on the host network: ``unshare --mount`` and a tmpfs),
no permission on the segment (mode 000, root without CAP_DAC_OVERRIDE via ``setpriv``),
or the segment owned by another user.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _workers import build, digest, mutate

from lightning_wsync import WeightSender

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
                       reason="needs root, unshare and setpriv (CI runs as root)"),  # fmt: skip
]
TESTS = Path(__file__).parent
WARNING = "cannot open the sender's shared-memory segment"


def cut_off(how: str, segment: str) -> list[str]:
    """The command prefix that runs the receiver without access to ``segment``."""
    if how == "own-dev-shm":
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"']  # fmt: skip
    if how == "no-permission":
        os.chmod(segment, 0)
        return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
    if how == "another-user":
        os.chown(segment, 65534, 65534)
        return []
    raise ValueError(how)


@pytest.mark.parametrize("how", ["own-dev-shm", "no-permission", "another-user"])
def test_receiver_that_cannot_open_the_segment_falls_back_to_the_network(children, port, how):
    model = build(("mixed", 0))
    store, job, last = f"127.0.0.1:{port}", f"fallback-{how}", 3
    with WeightSender(model, store=store, job=job, timeout_s=10) as sender:
        segment = f"/dev/shm/{sender._ring.segment.name}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
        proc = subprocess.Popen(
            [*cut_off(how, segment), sys.executable, str(TESTS / "_fallback_receiver.py"), store, job, str(last)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        children.track(proc.pid)
        lines: queue.Queue[str] = queue.Queue()
        out: list[str] = []
        reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
        reader.start()

        def next_line(prefix: str) -> str:
            deadline = time.monotonic() + 120
            while True:
                try:
                    line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    raise AssertionError(f"no {prefix!r} line from the receiver; it printed:\n{''.join(out)}") from None
                out.append(line)
                if line.startswith(prefix):
                    return line

        next_line("READY")
        for version in range(1, last + 1):
            mutate(model, version)
            report = sender.push(version).wait(timeout_s=60)
            assert report.delivered == ("r0",), (report, "".join(out))  # the sender serves it over gloo
            assert next_line("VERSION").split()[1:] == [str(version), digest(model)]
        assert proc.wait(timeout=30) == 0, "".join(out)
        reader.join(timeout=10)
        while not lines.empty():
            out.append(lines.get())
    warnings = [line for line in out if WARNING in line]
    assert len(warnings) == 1, "".join(out)
    assert os.path.basename(segment) in warnings[0] and "over the network (gloo)" in warnings[0]
