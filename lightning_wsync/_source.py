"""Where a receiver's versions come from for one sender epoch: one interface, two data planes.

:class:`SharedMemorySource` reads a ring on this host: ``update()`` pins the newest
complete slot and copies it straight into the module (one copy; the pin keeps the
bytes intact). :class:`NetworkSource` takes what a network link has already staged and
verified. :func:`open_source` picks one from the sender's record.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time
from collections.abc import Callable
from typing import Protocol

import torch

from lightning_wsync._manifest import Manifest, bind_views, copy_out, dtype_to_name
from lightning_wsync.errors import WeightSyncConfigError, WeightSyncIntegrityError, WeightSyncSchemaError
from lightning_wsync.transport.net import NetReceiveLink
from lightning_wsync.transport.shm import ShmReader, SlotRef, remove_stale_segments

SumsLookup = Callable[[int], "list[int] | None"]  # version -> its published bucket checksums
Reject = Callable[[int, str], None]  # (version, reason)

# A pin fails only when a push lands between reading the header and pinning; a copy is
# torn only when this receiver stalled past the sender's pin lease. Either way the next
# try takes the newest version; this many in a row means something is badly wrong.
log = logging.getLogger("lightning_wsync.receiver")

_SHARED_ATTEMPTS = 8
_PIN_ATTEMPTS = 64  # a pin fails while a push lands on that slot; each failure is a header read
_WOKEN_POLL_S = 0.02  # a reader the writer wakes still reads the header this often (a lost wake-up)


class ReceiveSource(Protocol):
    """The data plane of one sender epoch, as ``WeightReceiver`` uses it."""

    epoch: int

    def apply(self, held: int | None, sums: SumsLookup | None, reject: Reject) -> int | None:
        """Write one complete version above ``held`` into the module; return it (None: nothing newer)."""
        ...

    def pending_above(self, held: int | None) -> bool:
        """A complete version above ``held`` can be applied now."""
        ...

    def wait_change(self, until: float, give_up: Callable[[], bool]) -> bool:
        """Block until the source may have something new, ``until`` or ``give_up()``.

        Returns False when the source cannot tell (the caller then waits on the watcher).
        """
        ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


class SharedMemorySource:
    """A sender's ring on this host, applied slot by pinned slot."""

    def __init__(self, epoch: int, layout: Manifest, ordered: list[torch.Tensor], reader: ShmReader, name: str) -> None:
        self.epoch = epoch
        self.layout = layout
        self._ordered = ordered
        self._reader = reader
        self._name = name
        self._rejected: int | None = None  # a version that failed its checksums
        self._poll_s = 0.001

    def apply(self, held: int | None, sums: SumsLookup | None, reject: Reject) -> int | None:
        torn = False
        copies = 0
        for _ in range(_PIN_ATTEMPTS):
            if copies == _SHARED_ATTEMPTS:
                break
            ref = self._reader.newest()
            if ref is None or (held is not None and ref.version <= held and not torn) or ref.version == self._rejected:
                if torn:
                    break
                return None
            expected = None
            if sums is not None:
                expected = sums(ref.version)
                if expected is None:
                    if torn:
                        break
                    return None  # its checksums are not published yet; a later update() applies it
            if not self._reader.pin(ref):
                continue
            if expected is not None and not self._verified(ref, expected, reject):
                self._reader.unpin(ref)
                if torn:
                    break
                return None
            self._reader.copy_to(ref, self._ordered)
            copies += 1
            if self._reader.unpin(ref):
                return ref.version
            torn = True  # overwritten under us after a stall past the lease: copy the newest again
        if torn:
            raise WeightSyncIntegrityError(
                f"WeightReceiver {self._name!r}: the shared snapshot was overwritten under {_SHARED_ATTEMPTS} "
                f"copies in a row (this process stalled past the sender's pin lease each time); the module "
                f"may hold a torn copy. Check what stops this process, or push less often"
            )
        return None

    def _verified(self, ref: SlotRef, expected: list[int], reject: Reject) -> bool:
        bad = self._reader.mismatch(ref, expected)
        if bad is None:
            return True
        self._rejected = ref.version
        a, b = self.layout.buckets[bad]
        reject(ref.version, f"checksum mismatch in shared memory, first bad bytes [{a}, {b})")
        return False

    def pending_above(self, held: int | None) -> bool:
        ref = self._reader.newest()
        return ref is not None and (held is None or ref.version > held) and ref.version != self._rejected

    def wait_change(self, until: float, give_up: Callable[[], bool]) -> bool:
        """Wait on the writer's wake-up, reading the ring's header after each and every
        _WOKEN_POLL_S; without a wake-up socket, read it every ``_poll_s`` (1 ms: ~3% of a core)."""
        try:
            seen = self._reader.change_marker()
            poll_s = max(self._poll_s, _WOKEN_POLL_S) if self._reader.woken else self._poll_s
            while time.monotonic() < until and not give_up():
                self._reader.wait(min(poll_s, max(0.0, until - time.monotonic())))
                if self._reader.change_marker() != seen:
                    break
        except (AttributeError, ValueError):
            pass  # closed under us (a new sender epoch): the caller looks again
        return True

    def describe(self) -> str:
        return "shared memory"

    def close(self) -> None:
        self._reader.close()
        remove_stale_segments()  # a sender SIGKILLed before this epoch ended leaves its ring behind


class NetworkSource:
    """Versions a network link has staged and verified; applied by copy or by swapping buffers."""

    def __init__(
        self, epoch: int, layout: Manifest, ordered: list[torch.Tensor], link: NetReceiveLink, *, swap: bool
    ) -> None:
        self.epoch = epoch
        self.layout = layout
        self.link = link
        self._ordered = ordered
        self._swap = swap
        self._viewed: torch.Tensor | None = None  # swap: the staged buffer the module points at

    def apply(self, held: int | None, sums: SumsLookup | None, reject: Reject) -> int | None:
        if self._swap:
            return self.link.take_staged(held, self._viewed, self._bind)
        return self.link.take(lambda staging: copy_out(self.layout, staging, self._ordered), held)

    def pending_above(self, held: int | None) -> bool:
        return self.link.pending_above(held)

    def wait_change(self, until: float, give_up: Callable[[], bool]) -> bool:
        return False  # the link's on_staged callback wakes the receiver's waiters

    def _bind(self, buffer: torch.Tensor) -> None:
        first = self._viewed is None
        bind_views(self.layout, buffer, self._ordered)
        self._viewed = buffer
        if first and buffer.device.type == "cpu":
            _return_freed_pages()  # the module's own storage just went; the link allocates its successor

    def describe(self) -> str:
        return "network"

    def close(self) -> None:
        self.link.close()


def open_source(
    epoch: int,
    layout: Manifest,
    record: dict[str, object],
    ordered: list[torch.Tensor],
    *,
    host: str,
    name: str,
    net: Callable[[str], NetReceiveLink],
    swap: bool = False,
    fallback: bool = True,
) -> ReceiveSource:
    """The data plane the sender's record allows from this host.

    Same host by its host id, but the segment cannot be opened here (missing: another
    /dev/shm, as in a container on the host network; no permission; another user's):
    with ``transport='auto'`` and ``fallback``, the network path, said once in the log. A
    segment that opens but is not a wsync ring (a bad name, a symlink, not a regular file,
    no wsync header) stays a configuration error.
    """
    transport = str(record["transport"])
    backend = str(record["backend"])
    same_host = record["host"] == host and record["shm"] is not None
    if transport == "shm" and not same_host:
        raise WeightSyncConfigError(
            f"WeightReceiver {name!r}: the sender uses transport='shm' but runs on host "
            f"{record['host']!r}, not here ({host!r}); use transport='auto' or 'gloo' on the sender"
        )
    if transport in ("auto", "shm") and same_host:
        try:
            return SharedMemorySource(epoch, layout, ordered, ShmReader(str(record["shm"]), layout), name)
        except (FileNotFoundError, PermissionError) as exc:
            if transport == "shm" and isinstance(exc, PermissionError):
                raise WeightSyncConfigError(
                    f"WeightReceiver {name!r}: the sender uses transport='shm' but its segment {record['shm']!r} "
                    f"cannot be opened here ({exc.strerror}); run sender and receivers as one user, or use "
                    f"transport='auto' on the sender (the network path then serves this receiver)"
                ) from exc
            if transport == "shm" or not fallback:
                raise  # the segment is gone: that sender has ended
            log.warning(
                "receiver %r: cannot open the sender's shared-memory segment %r (%s); receiving over the network "
                "(%s) instead. Sender and receiver share a host id but not /dev/shm or a user (a container on the "
                "host network, another uid): run them in one IPC namespace as one user for the shared-memory "
                "path, or set a distinct WSYNC_HOST_ID per container to choose the network path without this "
                "warning", name, record["shm"], exc.strerror or exc, backend,
            )  # fmt: skip
    if swap:
        _check_swappable(layout, ordered, name, backend)
    return NetworkSource(epoch, layout, ordered, net(backend), swap=swap)


def _check_swappable(layout: Manifest, ordered: list[torch.Tensor], name: str, backend: str) -> None:
    """apply="swap" points tensors at the staging buffer: each must already be in its wire form."""
    want = torch.device("cpu") if backend == "gloo" else None
    for e, t in zip(layout.entries, ordered):
        device_ok = t.device == want if want is not None else t.device.type == "cuda"
        if t.dtype != e.wire_dtype or not device_ok:
            raise WeightSyncSchemaError(
                f"WeightReceiver {name!r}: apply='swap' needs every tensor as the {backend} link stages it, "
                f"but {e.name!r} is {dtype_to_name(t.dtype)} on {t.device} and arrives as "
                f"{dtype_to_name(e.wire_dtype)} on {want or 'the GPU'}; hold the module in the "
                f"wire dtype on that device, or use apply='copy'"
            )


def _return_freed_pages() -> None:
    """Ask glibc to unmap free heap pages; tensors below its mmap threshold stay mapped when freed."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc (musl): the memory is reused by the next allocation instead
