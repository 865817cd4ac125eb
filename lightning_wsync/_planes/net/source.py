"""The network plane's receive side: versions a link has staged and verified, applied by
copy or by pointing the module's tensors at the staged buffer."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

import torch

from lightning_wsync._control.manifest import Manifest, bind_views, copy_out
from lightning_wsync._planes.base import ReceiveSource, Reject, SumsLookup
from lightning_wsync._planes.net.link import NetReceiveLink
from lightning_wsync._planes.shm.cuda_host import wait_for_copies


class NetworkSource(ReceiveSource):
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
        # (Not staging.is_pinned(): it would start CUDA in a receiver whose module is on the CPU.)
        self._to_gpu = any(t.is_cuda for t in ordered)

    def apply(self, held: int | None, sums: SumsLookup | None, reject: Reject) -> int | None:
        if self._swap:
            return self.link.take_staged(held, self._viewed, self._bind)
        return self.link.take(self._copy_out, held)

    def _copy_out(self, staging: torch.Tensor) -> None:
        copy_out(self.layout, staging, self._ordered)
        if self._to_gpu and not staging.is_cuda:
            wait_for_copies()  # from page-locked staging the copy is asynchronous: done before the next receive

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


def _return_freed_pages() -> None:
    """Ask glibc to unmap free heap pages; tensors below its mmap threshold stay mapped when freed."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc (musl): the memory is reused by the next allocation instead
