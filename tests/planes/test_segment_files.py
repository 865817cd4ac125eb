"""Shared-memory segments and their pin directories: left-over segments are reclaimed
whatever PID namespace made them, live ones never are, and a name already taken is a
clear error that leaves nothing behind (issue 21 item 10)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from lightning_wsync._planes.shm.segment import ShmSegment, remove_stale_segments, unlink_segment
from lightning_wsync.errors import WeightSyncConfigError

_CREATOR = textwrap.dedent(
    """
    import os, sys
    from lightning_wsync._planes.shm.segment import ShmSegment, segment_name
    segment = ShmSegment(segment_name({job!r}, 0), 4096, create=True)
    print(segment.name, os.getpid(), flush=True)
    if {stay!r}:
        sys.stdin.read()  # alive until the test closes stdin
        segment.close()
    os._exit(0)  # gone without cleaning up, as a container that is restarted
    """
)

_unshare = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")


def _in_new_pid_namespace(children, job: str, stay: bool) -> tuple[subprocess.Popen[str], str]:
    """A process in a PID namespace of its own (a container over this /dev/shm) that creates a segment."""
    code = _CREATOR.format(job=job, stay=stay)
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "--", sys.executable, "-c",
                             code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    children.track(proc.pid)
    assert proc.stdout is not None
    name, pid = proc.stdout.readline().split()
    assert int(pid) != proc.pid  # a PID of its own namespace (1 or 2: what a restarted container's trainer has)
    return proc, name


@_unshare
@pytest.mark.timeout(60)
def test_a_segment_left_in_another_pid_namespace_is_reclaimed_and_a_live_one_is_not(children):
    """Failed before: only segments made in this PID namespace were judged, so a restarted
    container (new PID namespace, same /dev/shm) never reclaimed the dead trainer's."""
    dead, dead_name = _in_new_pid_namespace(children, f"restarted{os.getpid()}", stay=False)
    assert dead.wait(30) == 0
    live, live_name = _in_new_pid_namespace(children, f"running{os.getpid()}", stay=True)
    try:
        # (Any sender's sweep on this host may reclaim the dead one first: only what is left after ours counts.)
        assert os.path.exists(f"/dev/shm/{live_name}")
        remove_stale_segments()
        assert not os.path.exists(f"/dev/shm/{dead_name}") and not os.path.exists(f"/dev/shm/{dead_name}.pins")
        assert os.path.exists(f"/dev/shm/{live_name}") and os.path.exists(f"/dev/shm/{live_name}.pins")
        assert live.stdin is not None
        live.stdin.close()
        assert live.wait(30) == 0
        assert not os.path.exists(f"/dev/shm/{live_name}")  # its creator removed it on close
    finally:
        for name in (dead_name, live_name):
            unlink_segment(f"/dev/shm/{name}")


def test_a_live_segment_of_this_process_survives_a_sweep_and_a_closed_one_is_gone():
    segment = ShmSegment(f"wsync-{os.getpid()}-0-sweep", 4096, create=True)
    try:
        remove_stale_segments()
        assert os.path.exists(segment.path) and os.path.isdir(segment.pin_dir)
    finally:
        segment.close()
    assert not os.path.exists(segment.path) and not os.path.exists(segment.pin_dir)


def test_a_pre_created_pin_directory_is_a_clear_error_and_leaves_no_segment():
    """Failed before: the segment file was made first, then mkdir raised a raw FileExistsError
    and the segment file (the pushed bytes twice over) was left in /dev/shm."""
    name = f"wsync-{os.getpid()}-0-taken"
    os.mkdir(f"/dev/shm/{name}.pins")
    try:
        with pytest.raises(WeightSyncConfigError, match=r"its pin directory '/dev/shm/wsync-\d+-0-taken.pins' "
                           r"already exists.*give this job another name \(job=\)"):  # fmt: skip
            ShmSegment(name, 4096, create=True)
        assert not os.path.exists(f"/dev/shm/{name}")
        assert os.path.isdir(f"/dev/shm/{name}.pins")  # not ours: left as it was
    finally:
        unlink_segment(f"/dev/shm/{name}")


def test_a_pre_created_segment_file_is_a_clear_error_and_is_left_alone():
    name = f"wsync-{os.getpid()}-0-file"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"someone else's")
    try:
        with pytest.raises(WeightSyncConfigError, match=r"'/dev/shm/wsync-\d+-0-file' already exists without a pin"):
            ShmSegment(name, 4096, create=True)
        with open(f"/dev/shm/{name}", "rb") as f:
            assert f.read() == b"someone else's"
        assert not os.path.exists(f"/dev/shm/{name}.pins")
    finally:
        unlink_segment(f"/dev/shm/{name}")
