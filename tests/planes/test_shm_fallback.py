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

from lightning_wsync import WeightReceiver, WeightSender, WeightSyncConfigError

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
                       reason="needs root, unshare and setpriv (CI runs as root)"),  # fmt: skip
]
TESTS = Path(__file__).resolve().parents[1] / "support"
WARNING = "cannot open the sender's shared-memory segment"


def cut_off(how: str, segment: str) -> list[str]:
    """The command prefix that runs the receiver without access to ``segment``."""
    if how == "own-dev-shm":
        return ["unshare", "--mount", "--propagation", "private", "--kill-child", "--", "sh", "-c",
                'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"']  # fmt: skip
    if how == "no-permission":
        os.chmod(segment, 0)
        return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
    if how == "another-user":
        os.chown(segment, 65534, 65534)
        return []
    raise ValueError(how)


class Receiver:
    """``tests/support/_fallback_receiver.py`` under ``prefix``, its output read line by line."""

    def __init__(self, children, prefix: list[str], store: str, job: str, last: int) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(TESTS / "_fallback_receiver.py"), store, job, str(last)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        children.track(self.proc.pid)
        self.out: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=lambda: [self._lines.put(line) for line in self.proc.stdout],
                                        daemon=True)  # fmt: skip
        self._reader.start()

    def next_line(self, prefix: str) -> str:
        deadline = time.monotonic() + 120
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line from the receiver; it printed:\n{self.text}") from None
            self.out.append(line)
            if line.startswith(prefix):
                return line

    def finish(self) -> None:
        assert self.proc.wait(timeout=30) == 0, self.text
        self._reader.join(timeout=10)
        while not self._lines.empty():
            self.out.append(self._lines.get())

    @property
    def text(self) -> str:
        return "".join(self.out)


def serve(sender: WeightSender, model, receiver: Receiver, last: int) -> None:
    """Push versions 1..last; each must be acknowledged by r0 and applied bit-exact."""
    receiver.next_line("READY")
    for version in range(1, last + 1):
        mutate(model, version)
        report = sender.push(version).wait(timeout_s=60)
        assert report.delivered == ("r0",), (report, receiver.text)
        assert receiver.next_line("VERSION").split()[1:] == [str(version), digest(model)]
    receiver.finish()


@pytest.mark.parametrize("how", ["own-dev-shm", "no-permission", "another-user"])
def test_receiver_that_cannot_open_the_segment_falls_back_to_the_network(children, port, how):
    model = build(("mixed", 0))
    store, job, last = f"127.0.0.1:{port}", f"fallback-{how}", 3
    with WeightSender(model, store=store, job=job, timeout_s=10) as sender:
        segment = f"/dev/shm/{sender._ring.segment.name}"
        receiver = Receiver(children, cut_off(how, segment), store, job, last)
        serve(sender, model, receiver, last)  # the sender serves it over gloo
    warnings = [line for line in receiver.out if WARNING in line]
    assert len(warnings) == 1, receiver.text
    assert os.path.basename(segment) in warnings[0] and "over the network (gloo)" in warnings[0]


def test_receiver_in_another_pid_namespace_is_not_taken_for_dead(children, port):
    """A container sharing the host's id and /dev/shm has PIDs of its own: the sender must
    not judge the receiver's pid in its own namespace (before: "process <pid> exited")."""
    unused = next(pid for pid in range(30000, 1000, -1) if not os.path.exists(f"/proc/{pid}"))
    prefix = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "--", "sh", "-c",
              f'echo {unused - 1} > /proc/sys/kernel/ns_last_pid; "$0" "$@"; exit $?']  # fmt: skip
    model = build(("mixed", 0))
    store, job, last = f"127.0.0.1:{port}", "pidns", 3
    with WeightSender(model, store=store, job=job, timeout_s=10) as sender:
        receiver = Receiver(children, prefix, store, job, last)
        serve(sender, model, receiver, last)
        assert [m.pid for m in sender._members.members()] == [unused]  # a pid that means nothing here
    assert WARNING not in receiver.text  # shared memory: same /dev/shm, same user


def test_explicit_shm_transport_does_not_fall_back(port):
    store = f"127.0.0.1:{port}"
    with WeightSender(build(("mixed", 0)), store=store, job="shm-only", transport="shm", timeout_s=5) as sender:
        sender.push(1)
        os.chown(f"/dev/shm/{sender._ring.segment.name}", 65534, 65534)
        with (
            WeightReceiver(build(("mixed", 1)), store=store, job="shm-only", timeout_s=5) as receiver,
            pytest.raises(WeightSyncConfigError, match=r"transport='shm' but its segment .* cannot be opened here "
                                                       r"\(belongs to uid 65534.*use transport='auto'"),  # fmt: skip
        ):
            receiver.wait_for_version(1, timeout_s=5)
