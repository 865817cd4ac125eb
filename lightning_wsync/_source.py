"""Where a receiver's versions come from for one sender epoch, and how they are applied.

From a sender on this host the module is written straight from the shared snapshot
(one copy), as soon as the segment's header shows a newer complete version (the store's
announcement follows); torn copies are detected by the snapshot's sequence counter and redone,
after two tries through a private staging buffer so the module is written once from
bytes known to be whole. From a sender elsewhere a network link has already staged and
verified the version; applying it is one copy under the link's lock.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable

import torch

from lightning_wsync._manifest import Layout, _dtype_name, bind_views, copy_out
from lightning_wsync.errors import WeightSyncError, WeightSyncIntegrityError, WeightSyncSchemaError
from lightning_wsync.transport.net import NetReceiveLink
from lightning_wsync.transport.shm import ShmReceiveLink

Latest = tuple[int, int, int]  # (version, epoch, gen) as last read from the store

_DIRECT_ATTEMPTS = 2


class Source:
    """The data plane of one sender epoch, as the receiver uses it."""

    def __init__(
        self, epoch: int, layout: Layout, ordered: list[torch.Tensor],
        shm: ShmReceiveLink | None, net: NetReceiveLink | None, *, swap: bool = False,
    ) -> None:  # fmt: skip
        self.epoch = epoch
        self.layout = layout
        self.shm = shm
        self.net = net
        self._ordered = ordered
        self._swap = swap and net is not None
        self._viewed: torch.Tensor | None = None  # swap: the staged buffer the module points at
        self._staging: torch.Tensor | None = None
        self._rejected: int | None = None  # a shared version that failed its checksums

    @classmethod
    def open(
        cls,
        epoch: int,
        layout: Layout,
        record: dict[str, object],
        ordered: list[torch.Tensor],
        *,
        host: str,
        name: str,
        net: Callable[[str], NetReceiveLink],
        swap: bool = False,
    ) -> Source:
        """Pick the data plane the sender's record allows from this host."""
        transport = str(record["transport"])
        same_host = record["host"] == host and record["shm"] is not None
        if transport == "shm" and not same_host:
            raise WeightSyncError(
                f"WeightReceiver {name!r}: the sender uses transport='shm' but runs on host "
                f"{record['host']!r}, not here ({host!r}); use transport='auto' or 'gloo' on the sender"
            )
        if transport in ("auto", "shm") and same_host:
            return cls(epoch, layout, ordered, ShmReceiveLink(str(record["shm"]), layout), None)
        backend = str(record["backend"])
        if swap:
            _check_swappable(layout, ordered, name, backend)
        return cls(epoch, layout, ordered, None, net(backend), swap=swap)

    def describe(self) -> str:
        return "shared memory" if self.shm is not None else "network"

    @property
    def watches_shared_memory(self) -> bool:
        """Whether a blocked waiter should watch a segment (wait_shared_change) rather than the store."""
        return self.shm is not None

    def apply(
        self,
        held: int | None,
        latest: Callable[[], Latest | None],
        wait: Callable[[], None],
        timeout_s: float,
        name: str,
        sums: Callable[[int, int], list[int] | None] | None = None,
        reject: Callable[[int, str], None] | None = None,
    ) -> int | None:
        """Write the newest complete version above ``held`` into the module; return it.

        With ``sums`` (shared memory only), a version is applied only once its published
        bucket checksums are known and match; a mismatch is passed to ``reject``.
        """
        if self.net is not None:
            return self._apply_staged(self.net, held)
        if sums is not None:
            newest = latest()
            if not self._verified(held, newest, sums, reject):
                return None
            # Exactly the verified bytes, once: if a push overwrote them meanwhile, the
            # newer version is verified on a later update().
            assert self.shm is not None and newest is not None
            return newest[0] if self.shm.try_apply(newest[2], self._ordered) else None
        return self._apply_shared(held, latest, wait, timeout_s, name)

    def _verified(
        self,
        held: int | None,
        newest: Latest | None,
        sums: Callable[[int, int], list[int] | None],
        reject: Callable[[int, str], None] | None,
    ) -> bool:
        assert self.shm is not None
        if newest is None or (held is not None and newest[0] <= held) or newest[0] == self._rejected:
            return False
        version, _, gen = newest
        expected = sums(version, gen)
        if expected is None:
            return False  # not published yet; a later update() applies it
        bad = self.shm.matches(gen, expected)
        if bad is None:
            return True
        if self.shm.sequence() == gen:  # not merely overwritten by the next push: corrupt
            self._rejected = version
            a, b = self.layout.buckets[bad]
            if reject is not None:
                reject(version, f"checksum mismatch in shared memory, first bad bytes [{a}, {b})")
        return False

    def _apply_staged(self, link: NetReceiveLink, held: int | None) -> int | None:
        if self._swap:
            return link.take_staged(held, self._viewed, self._bind)
        with link.lock:
            staged = link.staged_version
            if staged is None or link.staging is None or (held is not None and staged <= held):
                return None
            copy_out(link.layout, link.staging, self._ordered)
            return staged

    def _newest(self, announced: Latest | None) -> Latest | None:
        """The store's newest version, or the segment's own if that is newer (not yet announced)."""
        assert self.shm is not None
        local = self.shm.published()
        if local is None or (announced is not None and announced[0] >= local[0]):
            return announced
        return local[0], self.epoch, local[1]

    def wait_shared_change(self, until: float, give_up: Callable[[], bool], poll_s: float) -> None:
        """Sleep until the segment's sequence counter moves, ``until``, or ``give_up()``.

        One memory read per ``poll_s`` (at 1 ms, ~3% of a core while waiting).
        """
        assert self.shm is not None
        try:
            seen = self.shm.sequence()
            while time.monotonic() < until and not give_up():
                time.sleep(poll_s)
                if self.shm.sequence() != seen:
                    return
        except (AttributeError, ValueError):
            return  # closed under us (a new sender epoch): the caller looks again

    def _bind(self, buffer: torch.Tensor) -> None:
        first = self._viewed is None
        bind_views(self.layout, buffer, self._ordered)
        self._viewed = buffer
        if first and buffer.device.type == "cpu":
            _return_freed_pages()  # the module's own storage just went; the link allocates its successor

    def _apply_shared(
        self, held: int | None, latest: Callable[[], Latest | None], wait: Callable[[], None], timeout_s: float, name: str
    ) -> int | None:
        assert self.shm is not None
        deadline = time.monotonic() + timeout_s
        attempt = 0
        while True:
            newest = self._newest(latest())
            if newest is None or (held is not None and newest[0] <= held):
                return None
            version, epoch, gen = newest
            if epoch != self.epoch:
                return None  # a new sender took over; the watcher is switching sources
            if attempt < _DIRECT_ATTEMPTS:
                if self.shm.try_apply(gen, self._ordered):
                    return version
            else:
                # Pushes keep landing while we copy: stage privately so the module is
                # written once, from bytes known to be whole.
                if self._staging is None:
                    self._staging = torch.empty(self.layout.total_bytes, dtype=torch.uint8)
                if self.shm.stage(gen, self._staging):
                    copy_out(self.layout, self._staging, self._ordered)
                    return version
            attempt += 1
            if time.monotonic() > deadline:
                raise WeightSyncIntegrityError(
                    f"WeightReceiver {name!r}: the shared snapshot changed under every copy for "
                    f"timeout_s={timeout_s}; the module may hold a torn copy. The trainer pushes faster "
                    f"than this receiver copies: push less often, or raise timeout_s"
                )
            wait()

    def close(self) -> None:
        if self.net is not None:
            self.net.close()
        if self.shm is not None:
            self.shm.close()


def _check_swappable(layout: Layout, ordered: list[torch.Tensor], name: str, backend: str) -> None:
    """apply="swap" points tensors at the staging buffer: each must already be in its wire form."""
    want = torch.device("cpu") if backend == "gloo" else None
    for e, t in zip(layout.entries, ordered):
        device_ok = t.device == want if want is not None else t.device.type == "cuda"
        if t.dtype != e.wire_dtype or not device_ok:
            raise WeightSyncSchemaError(
                f"WeightReceiver {name!r}: apply='swap' needs every tensor as the {backend} link stages it, "
                f"but {e.name!r} is {_dtype_name(t.dtype)} on {t.device} and arrives as "
                f"{_dtype_name(e.wire_dtype)} on {want or 'the GPU'}; hold the module in the "
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
