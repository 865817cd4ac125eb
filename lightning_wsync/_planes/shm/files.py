"""Shared-memory segment files: which names are ours, and opening one without following
a link or reading another user's file (segment names arrive from the store: untrusted)."""

from __future__ import annotations

import errno
import os
import re
import stat

from lightning_wsync.errors import WeightSyncConfigError

SHM_DIR = "/dev/shm"


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
