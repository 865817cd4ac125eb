"""Shared-memory segment files: which names are ours, opening one without following a
link or reading another user's file (segment names arrive from the store: untrusted),
and when a segment is left over.

A segment ``<name>`` has a pin directory ``<name>.pins`` whose ``owner`` file its creator
holds an exclusive ``flock`` on for its whole life. The directory and the lock come first,
the segment file after, so a segment file whose owner lock anyone can take is left over:
its creator is gone, in whatever PID namespace it ran (a container restarted with a new
PID namespace over the same pod ``/dev/shm`` reclaims the dead trainer's segment). The
kernel drops the lock when the last descriptor on it closes, so no PID, start time or
namespace has to be compared: a reused PID or a namespace this process cannot see cannot
make a live segment look dead. (A child forked from the creator inherits the descriptor
and keeps the segment until it exits too: late, never early.)
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat

from lightning_wsync._control.host import pid_alive, pid_namespace
from lightning_wsync.errors import WeightSyncConfigError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
OWNER = "owner"
_LOCKED = "wsync-lock"  # an owner file's first word when its creator holds a flock on it
_PIDNS = pid_namespace()


# What transport.shm.segment_name() makes: wsync-<pid>-<epoch>-<job with [A-Za-z0-9_.-] only>.
_SEGMENT_NAME = re.compile(r"wsync-[0-9]{1,10}-[0-9]{1,20}-[A-Za-z0-9_.-]{0,64}")


def check_segment_name(name: object) -> str:
    """``name`` if it is a segment name lightning_wsync creates (read from the store: untrusted)."""
    if not isinstance(name, str) or not _SEGMENT_NAME.fullmatch(name):
        raise WeightSyncConfigError(
            f"shared-memory segment name {name!r} (from the sender's record on the store) is not one "
            f"lightning_wsync creates ('wsync-<pid>-<epoch>-<job>', no '/'); refused. A peer without the "
            f"job's secret wrote it: set the same WSYNC_SECRET on every peer and firewall the store's port"
        )
    return name


def open_segment(path: str, flags: int, mode: int = 0o600) -> int:
    """Open a shared-memory segment file safely: a valid name directly under /dev/shm, no
    symlink followed, a regular file, and (when not creating it) owned by this user.

    Raises:
        WeightSyncConfigError: the name, a symlink, not a regular file (not a wsync segment).
        OSError: it cannot be opened here (FileNotFoundError, PermissionError; also for a
            file of another user), which a receiver with ``transport='auto'`` works around.
    """
    if not path.startswith(SHM_DIR + "/"):
        raise WeightSyncConfigError(f"shared-memory segment {path!r} is not under {SHM_DIR!r}; refused")
    check_segment_name(path[len(SHM_DIR) + 1 :])
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the name is a symlink
            raise WeightSyncConfigError(
                f"shared-memory segment {path!r} is a symbolic link; refused (segments are regular files "
                f"that the sender creates): remove it, and check who else writes to {SHM_DIR}"
            ) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise WeightSyncConfigError(
            f"shared-memory segment {path!r} is not a regular file; it is not a snapshot of a sender of this "
            f"user: remove it, and check who else writes to {SHM_DIR}"
        )
    if not flags & os.O_CREAT and info.st_uid != os.geteuid():
        os.close(fd)  # not this user's to read: as if it could not be opened (a receiver takes the network)
        raise PermissionError(errno.EACCES, f"belongs to uid {info.st_uid}, not this process's uid {os.geteuid()}",
                              path)  # fmt: skip
    return fd


def pin_dir(path: str) -> str:
    return path + ".pins"


def reserve(path: str) -> int:
    """Make ``path``'s pin directory and take its owner lock, before the segment file exists.

    Returns the lock's descriptor: hold it while the segment lives (:func:`unlink_segment`
    then close it).

    Raises:
        WeightSyncConfigError: the pin directory already exists.
    """
    pins = pin_dir(path)
    try:
        os.mkdir(pins, 0o700)
    except FileExistsError:
        raise WeightSyncConfigError(
            f"shared-memory segment {path!r}: its pin directory {pins!r} already exists, and a live process "
            f"holds it or it is not a wsync segment's; refused. Another sender of the same pid, epoch and job "
            f"in a container sharing {SHM_DIR}, or a directory someone else made: give this job another "
            f"name (job=), or remove {pins!r} if no trainer uses it"
        ) from None
    try:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(os.path.join(pins, OWNER), flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{_LOCKED} {_PIDNS}".encode())
        except OSError:
            os.close(fd)
            raise
    except OSError:
        shutil.rmtree(pins, ignore_errors=True)
        raise
    return fd


def unlink_segment(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    shutil.rmtree(pin_dir(path), ignore_errors=True)


def remove_stale_segments() -> None:
    """Unlink this user's segments (and bare pin directories) whose creator is gone."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith("wsync-")]
    except OSError:
        return
    for base in sorted({n.removesuffix(".pins") for n in names}):
        path = os.path.join(SHM_DIR, base)
        if _SEGMENT_NAME.fullmatch(base) and _left_over(path):
            unlink_segment(path)
            log.info("removed stale shared-memory snapshot %s", path)


def _left_over(path: str) -> bool:
    """Whether nobody holds the segment's owner lock (written by an older version: its
    creator ran in this PID namespace and its PID is gone). No owner file: not judged."""
    try:
        fd = os.open(os.path.join(pin_dir(path), OWNER), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return False
        words = os.read(fd, 64).decode(errors="replace").split()
        if words[:1] == [_LOCKED]:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True  # released when fd closes: nobody takes a left-over directory again
        match = re.match(r"wsync-(\d+)-", os.path.basename(path))
        return match is not None and words == [str(_PIDNS)] and not pid_alive(int(match.group(1)))
    finally:
        os.close(fd)
