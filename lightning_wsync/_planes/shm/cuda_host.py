"""Snapshot memory registered with CUDA, so copies between a GPU and a slot run at DMA speed.

A device-to-host copy into ordinary (pageable) memory goes through the driver's staging
buffer; into registered memory it is one DMA transfer. Measured on an H200
(``python -m lightning_wsync.bench._gpu``): 11.8 GB/s into a ``/dev/shm`` mapping as the
ring has it, 55 GB/s once the mapping is registered, and 7.0 against 55 GB/s back onto
the GPU. Registering 1 GiB took 61 ms, once per mapping.

Copies from or into registered memory are asynchronous: whoever starts one must wait
for it (a CUDA event) before the bytes are published, released or overwritten.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: required for a mapping the process may only read


class HostRegistration:
    """One registered address range; :meth:`release` unregisters it (before it is unmapped)."""

    def __init__(self, ptr: int) -> None:
        self._ptr: int | None = ptr

    def release(self) -> None:
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]


def register(buffer: torch.Tensor, *, read_only: bool, what: str) -> HostRegistration | None:
    """Register ``buffer``'s memory with CUDA; None (the copies stay pageable, at a lower
    speed) when CUDA refuses it, which is logged once with CUDA's reason.

    Only called by a process that already copies to or from a GPU: it never initializes
    CUDA in a CPU-only process.
    """
    nbytes = buffer.numel() * buffer.element_size()
    if nbytes == 0 or not torch.cuda.is_available():
        return None
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, _READ_ONLY if read_only else 0))
    if err != 0:
        clear_last_error()
        log.warning(
            "%s: cannot register %.1f MiB of shared memory with CUDA (cudaError %d); copies to and from "
            "the GPU stay pageable (about 5x slower); check the locked-memory limit (ulimit -l)",
            what, nbytes / 2**20, err,
        )  # fmt: skip
        return None
    return HostRegistration(buffer.data_ptr())


def clear_last_error() -> None:
    """Reset CUDA's last error, which the failed call set: torch checks it after kernel
    launches and would raise this error there. torch does not bind cudaGetLastError."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def wait_for_copies() -> None:
    """Wait for the copies this thread queued on the current CUDA stream (and nothing else:
    a device-wide sync would also wait for NCCL sends in flight)."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    event.synchronize()


class CopyStream:
    """A stream of its own, per device, for a ring's copies from a GPU.

    The copies start after the work already queued on the caller's stream (the weights
    as of the push) and run beside whatever is queued after; only the pushing thread
    waits, on an event of these copies: no device-wide synchronize, which would also
    wait for NCCL sends in flight (a stalled receiver's included) and the trainer's
    other streams.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def run(self, device: torch.device, copies: Callable[[], None]) -> None:
        """Queue ``copies`` on this device's stream and wait until they are done."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            copies()
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        event.synchronize()
