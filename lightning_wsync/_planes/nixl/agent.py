"""The one module that imports NIXL: whether it is usable here, agents, their records.

NIXL (``nixl-cu12``, the ``[nixl]`` extra) is optional. :func:`unusable` says why it
cannot be used here (not installed, no UCX backend), once per process; everything else
goes through :class:`Agent`, a small wrapper over ``nixl_agent`` that owns its
registrations and remote agents and drops them all in :meth:`Agent.close`.
"""

from __future__ import annotations

import base64
import binascii
import functools
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from lightning_wsync._control.records import DeviceRegion, NixlAgentRecord

log = logging.getLogger(__name__)

_BACKEND = "UCX"


class Memory(NamedTuple):
    """NIXL's memory kind of a transfer's ranges (``DRAM``: host; ``VRAM``: CUDA device ``device``)."""

    kind: str
    device: int


DRAM = Memory("DRAM", 0)


class NixlError(RuntimeError):
    """A NIXL call failed (a peer gone, metadata that does not load, a transfer in error)."""


class NotPublished(NixlError):
    """The peer to read from has not published its NIXL agent yet: usual while a chain forms
    or a sender starts, so its readers say it at DEBUG until it lasts ``timeout_s``."""


class Failures:
    """A reader's failed attempts in a row (a hop's thread, a receiver's): each failure said once.

    The first attempt that fails saying something is a WARNING (a peer not published yet only once
    that has lasted ``timeout_s``: usual while a chain forms or a sender starts); the same failure
    again, attempt after attempt while it lasts (a garbled record, a peer that does not answer), is
    DEBUG, so a reader that waits on a bad record says so once, not once a second.
    """

    def __init__(self, timeout_s: float) -> None:
        self.count = 0
        self.last: str | None = None  # the last failure, for describe()
        self._timeout_s = timeout_s
        self._since = 0.0
        self._said: str | None = None

    def failed(self, exc: Exception) -> int:
        """Count a failed attempt; the level to log it at."""
        self.count += 1
        self._since = time.monotonic() if self.count == 1 else self._since
        self.last = text = str(exc)
        if isinstance(exc, NotPublished) and time.monotonic() - self._since < self._timeout_s:
            return logging.DEBUG
        if text == self._said:
            return logging.DEBUG
        self._said = text
        return logging.WARNING

    def cleared(self) -> None:
        """An attempt went through: the next failure is news again."""
        self.count = 0
        self._said = None


class Refusals:
    """Reader agents an owner ignores because their record did not load (garbled, or NIXL refused its
    metadata): each refusal said once per reason, and the reader's record read again at most every
    ``retry_s`` when it asks (its writer may put it back; it is then answered).
    """

    def __init__(self, retry_s: float = 1.0) -> None:
        self._retry_s = retry_s
        self._refused: dict[str, tuple[str, float]] = {}  # agent -> (why, when its record may be read again)

    def resting(self, peer: str) -> bool:
        """Whether ``peer`` was refused less than ``retry_s`` ago: ignore it without reading its record."""
        got = self._refused.get(peer)
        return got is not None and time.monotonic() < got[1]

    def refuse(self, peer: str, why: str) -> int:
        """Note a refusal; the level to log it at (WARNING the first time for this reason, then DEBUG)."""
        said = self._refused.get(peer)
        if len(self._refused) > 1024:  # bounded, whatever agent names ask
            self._refused.clear()
        self._refused[peer] = (why, time.monotonic() + self._retry_s)
        return logging.DEBUG if said is not None and said[0] == why else logging.WARNING

    def accepted(self, peer: str) -> None:
        self._refused.pop(peer, None)


@functools.lru_cache(maxsize=1)
def unusable() -> str | None:
    """Why NIXL cannot be used in this process (None: it can), found once."""
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config  # noqa: F401
    except ImportError as exc:
        return f"NIXL is not installed ({exc}); pip install 'lightning-wsync[nixl]' (docs/nixl.md)"
    except Exception as exc:  # noqa: BLE001 - a broken native library must mean "not usable", never a crash
        return f"NIXL does not load here ({type(exc).__name__}: {exc})"
    try:
        probe = Agent(f"wsync-probe-{os.getpid()}")
    except NixlError as exc:  # e.g. UCX_TLS asks for transports this host lacks (rc without an RDMA NIC)
        ucx = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("UCX_"))
        return f"{exc} ({'UCX settings: ' + ucx + '; ' if ucx else ''}UCX logs the cause)"
    probe.close()
    return None


class Agent:
    """One NIXL agent with the UCX backend, its registered memory and its remote agents."""

    def __init__(self, name: str) -> None:
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config

            self._nixl: Any = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[_BACKEND]))
        except Exception as exc:  # noqa: BLE001 - the binding raises its own (untyped) errors
            raise NixlError(f"NIXL agent {name!r} could not start: {type(exc).__name__}: {exc}") from None
        if _BACKEND not in self._nixl.backends:
            raise NixlError(f"NIXL agent {name!r}: no {_BACKEND} backend (plugins: {self._nixl.plugin_list})")
        self.name = name
        self._registered: list[Any] = []
        self._remote: set[str] = set()
        self._handles: list[Any] = []
        self.lock = threading.RLock()  # one thread at a time through the agent (close from another)

    # -- memory -------------------------------------------------------------------------
    def register(self, tensors: Sequence[torch.Tensor]) -> Any:
        """Register contiguous tensors, all on one device (host: ``DRAM``; a GPU: ``VRAM`` with its
        index, as ``nixl_agent.get_reg_descs`` reads them); a handle for :meth:`deregister`."""
        try:
            handle = self._nixl.register_memory(list(tensors))
        except Exception as exc:  # noqa: BLE001
            raise NixlError(f"NIXL agent {self.name!r} could not register memory: {exc}") from None
        self._registered.append(handle)
        return handle

    def deregister(self, handle: Any) -> None:
        if any(h is handle for h in self._registered):  # by identity: descriptor lists may compare by content
            self._registered = [h for h in self._registered if h is not handle]
            try:
                self._nixl.deregister_memory(handle)
            except Exception as exc:  # noqa: BLE001
                log.debug("NIXL agent %r: deregistering: %s", self.name, exc)

    def metadata(self) -> str:
        return base64.b64encode(self._nixl.get_agent_metadata()).decode("ascii")

    def record(self, regions: Sequence[tuple[int, int]] = (), mirror: Sequence[DeviceRegion] = ()) -> NixlAgentRecord:
        return NixlAgentRecord(self.name, os.getpid(), self.metadata(), tuple(regions), tuple(mirror))

    # -- peers --------------------------------------------------------------------------
    def add_remote(self, record: NixlAgentRecord) -> None:
        """Load a peer's metadata (idempotent); NixlError when it does not decode or load."""
        if record.name in self._remote:
            return
        try:
            metadata = base64.b64decode(record.metadata, validate=True)
        except (binascii.Error, ValueError):
            raise NixlError(f"NIXL agent {record.name!r}: its metadata is not base64") from None
        try:
            loaded = self._nixl.add_remote_agent(metadata)
        except Exception as exc:  # noqa: BLE001
            raise NixlError(f"NIXL agent {record.name!r}: its metadata does not load ({exc})") from None
        got = loaded.decode("utf-8", "replace") if isinstance(loaded, bytes) else str(loaded)
        self._remote.add(got)
        if got != record.name:
            self.remove_remote(got)
            raise NixlError(f"NIXL agent {record.name!r}: its metadata names another agent, {got!r}")

    def remove_remote(self, name: str) -> None:
        if name in self._remote:
            self._remote.discard(name)
            try:
                self._nixl.remove_remote_agent(name)
            except Exception as exc:  # noqa: BLE001
                log.debug("NIXL agent %r: removing %r: %s", self.name, name, exc)

    def notify(self, peer: str, message: bytes) -> None:
        try:
            self._nixl.send_notif(peer, message)
        except Exception as exc:  # noqa: BLE001
            raise NixlError(f"NIXL agent {self.name!r}: a message to {peer!r} failed ({exc})") from None

    def messages(self) -> dict[str, list[bytes]]:
        """New notifications: agent name -> messages in arrival order."""
        try:
            got: dict[str, list[bytes]] = self._nixl.get_new_notifs()
        except Exception as exc:  # noqa: BLE001
            raise NixlError(f"NIXL agent {self.name!r}: reading notifications failed ({exc})") from None
        return got

    # -- transfers ----------------------------------------------------------------------
    def post_read(self, peer: str, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]],
                  note: bytes = b"", *, local_mem: Memory = DRAM, remote_mem: Memory = DRAM) -> Any:  # fmt: skip
        """Post a one-sided READ of ``remote`` (address, bytes) ranges of ``peer`` into ``local``; a handle.

        ``local_mem``/``remote_mem``: the ranges' memory kind and device, as each side registered them
        (NIXL matches a descriptor to a registration by kind, device and address range)."""
        try:
            ld = self._nixl.get_xfer_descs([(a, n, local_mem.device) for a, n in local], local_mem.kind)
            rd = self._nixl.get_xfer_descs([(a, n, remote_mem.device) for a, n in remote], remote_mem.kind)
            handle = self._nixl.initialize_xfer("READ", ld, rd, peer, note)
        except Exception as exc:  # noqa: BLE001
            raise NixlError(f"NIXL agent {self.name!r}: a READ from {peer!r} could not be set up ({exc})") from None
        self._handles.append(handle)
        try:
            state = self._nixl.transfer(handle)
        except Exception as exc:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError: the peer died since set-up
            self.release(handle)
            raise NixlError(f"NIXL agent {self.name!r}: a READ from {peer!r} could not be posted ({exc})") from None
        if state == "ERR":
            self.release(handle)
            raise NixlError(f"NIXL agent {self.name!r}: a READ from {peer!r} failed to start")
        return handle

    def done(self, handle: Any) -> bool:
        """Whether a posted READ completed; NixlError when it failed."""
        try:
            state = self._nixl.check_xfer_state(handle)
        except Exception as exc:  # noqa: BLE001 - the binding raises its own errors for a peer gone
            raise NixlError(f"NIXL agent {self.name!r}: a READ's state could not be read ({exc})") from None
        if state == "ERR":
            raise NixlError(f"NIXL agent {self.name!r}: a READ failed (its peer gone or unreachable)")
        return bool(state == "DONE")

    def release(self, handle: Any) -> None:
        if handle in self._handles:
            self._handles.remove(handle)
        try:
            handle.release()
        except Exception as exc:  # noqa: BLE001 - still in flight after a peer died: NIXL keeps it for its __del__
            log.debug("NIXL agent %r: releasing a transfer: %s", self.name, exc)

    def close(self) -> None:
        """Release every transfer, remote agent and registration; the agent goes with the last reference."""
        with self.lock:
            for handle in list(self._handles):
                self.release(handle)
            for name in list(self._remote):
                self.remove_remote(name)
            for registered in self._registered:
                try:
                    self._nixl.deregister_memory(registered)
                except Exception as exc:  # noqa: BLE001
                    log.debug("NIXL agent %r: deregistering: %s", self.name, exc)
            self._registered.clear()
            self._nixl = None
