"""The memory fence of the pin protocol (:mod:`~lightning_wsync._planes.shm.segment`).

Pinning is Dekker's pattern across processes: the writer stores a slot's "being written"
mark, then loads the readers' pins; a reader stores its pin, then loads the slot's
sequence. It is safe only if each side's store is ordered before its own load
(StoreLoad), so that at least one side sees the other; the sequence checks around a copy
need its loads ordered too.

Python offers no fence. A lock round trip is one on x86-64 (a locked instruction), but on
ARM an acquire-release pair lets a later load pass an earlier store. Linux's
``membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)``, reached through ``ctypes`` with no C
extension, runs ``smp_mb()`` on the calling CPU on entry and on exit (and on the CPUs of
processes registered for it: none here), so :func:`fence` is a sequentially consistent
fence on every architecture, for ~1 us. Where the kernel refuses it (before 4.16, or a
seccomp profile without it) the lock round trip stays: still a full fence on x86-64,
and on ARM the sequence re-checks of the protocol catch what it lets through.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

# The syscall's number where it is not the generic one (283: aarch64, riscv64, loongarch64).
_MEMBARRIER_NR = {"x86_64": 324, "i686": 375, "ppc64le": 365, "ppc64": 365, "s390x": 356, "armv7l": 389}
_CMD_QUERY, _CMD_GLOBAL_EXPEDITED = 0, 1 << 1
_lock = threading.Lock()


def lock_fence() -> None:
    """A lock round trip: a full barrier on x86-64, less on ARM (see the module text)."""
    with _lock:
        pass


def _membarrier() -> Callable[[], int] | None:
    nr = _MEMBARRIER_NR.get(platform.machine(), 283)
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    supported = int(syscall(nr, _CMD_QUERY, 0, 0))
    if supported < 0 or not supported & _CMD_GLOBAL_EXPEDITED:
        log.debug("membarrier(GLOBAL_EXPEDITED) unavailable (%d): shared-memory pins fence with a lock", supported)
        return None
    return lambda: int(syscall(nr, _CMD_GLOBAL_EXPEDITED, 0, 0))


_MEMBARRIER = _membarrier()
SEQUENTIALLY_CONSISTENT = _MEMBARRIER is not None or platform.machine() in ("x86_64", "AMD64")


def fence() -> None:
    """A full memory barrier on this CPU: membarrier where the kernel has it, else a lock round trip."""
    if _MEMBARRIER is None or _MEMBARRIER() != 0:
        lock_fence()
