"""The NIXL plane's receive side: a thread READs each new version from the owner's ring
into a staging buffer of two halves, verifies it, and ``update()`` copies the newest
verified half into the module (never waiting on the network).

One version, in order (docs/nixl.md): ask the owner for a pin and get its grant (slot,
sequence, signed trailer); READ the slot chunk by chunk (each completed chunk tells the
owner the reader is alive); READ the slot's sequence and version words again; unpin.
The version is staged only if the words did not move and every bucket's checksum
matches the signed trailer (:func:`~lightning_wsync._planes.wire.verify`).

With the module on a GPU and an owner that lends its ring's GPU mirror (``cuda_ipc=True``),
the payload is READ from the mirror into two halves on the module's GPU (device to device),
and applied from there; the slot's words are still READ from the host header page, which
the mirror shares. The trailer's checksums are of host bytes, so each bucket is copied
into a page-locked host buffer and hashed: one device-to-host copy of the version (tens
of GB/s) besides the hashing the host path does anyway. Where that path cannot be used
(the module not on one GPU, no mirror lent, NIXL refusing the device buffer, or the first
READ from the mirror failing), versions are READ through host memory, said once.

Longer than 300 lines: one reader's protocol (pin, READ, the words read again, verify, stage)
with its two kinds of buffer, host and device, which share every step but where the bytes land.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_wsync._control import keys
from lightning_wsync._control.manifest import Manifest, checksum, copy_out
from lightning_wsync._control.records import NixlAgentRecord
from lightning_wsync._control.store import Control
from lightning_wsync._planes.base import ReceiveSource, Reject, SumsLookup
from lightning_wsync._planes.nixl import messages
from lightning_wsync._planes.nixl.agent import DRAM, Agent, Failures, Memory, NixlError, NotPublished
from lightning_wsync._planes.nixl.send import reader_name
from lightning_wsync._planes.shm.cuda_host import wait_for_copies
from lightning_wsync._planes.shm.ring import bucket_checksums
from lightning_wsync._planes.shm.segment import seq_word_offset
from lightning_wsync._planes.wire import Arrival, to_int64, verify
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.005  # a new version is looked for (in this process: the watcher's latest) this often
_WINDOW = 4  # chunk READs in flight


class Torn(Exception):
    """The slot moved under the READ (this reader stalled past the owner's lease)."""


def module_device(tensors: Sequence[torch.Tensor]) -> torch.device | None:
    """The one CUDA device ``tensors`` are on; None when any is elsewhere."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return None
    (device,) = devices
    return device if device.type == "cuda" else None


def mirror_refused(device: torch.device | None, record: NixlAgentRecord, nbytes: int) -> str | None:
    """Why versions cannot be READ from the owner's GPU mirror into ``device``; None: they can."""
    if device is None:
        return "the module is not on one CUDA device"
    if not record.mirror:
        return "the sender lends no GPU mirror (it runs without cuda_ipc=True, or its NIXL refused the mirror)"
    if len(record.mirror) != len(record.regions) - 1 or any(m.size != nbytes for m in record.mirror):
        return f"the sender's GPU mirror {record.mirror!r:.80} does not fit this layout"
    if not torch.cuda.is_available():
        return "CUDA is not usable in this process"
    return None


class NixlReader:
    """Stages versions READ from the owner's ring; :class:`NixlSource` applies them."""

    def __init__(
        self, ctl: Control, layout: Manifest, *, epoch: int, rid: int, timeout_s: float, chunk_bytes: int,
        newest: Callable[[], int | None], on_staged: Callable[[int], None], on_rejected: Callable[[int, str], None],
        device: torch.device | None = None,
    ) -> None:  # fmt: skip
        self._ctl = ctl
        self.layout = layout
        self._epoch = epoch
        self._rid = rid
        self._timeout_s = timeout_s
        self._chunk = max(1 << 16, chunk_bytes)
        self._newest = newest
        self._on_staged = on_staged
        self._on_rejected = on_rejected
        nbytes = layout.total_bytes
        self._staging = torch.empty(2 * nbytes, dtype=torch.uint8)
        self.halves = [self._staging[:nbytes], self._staging[nbytes:]]
        self._host_halves = self.halves
        self._device = device  # the module's GPU: READ into halves there when the owner lends its mirror
        self._path_chosen = False
        self.host_reason: str | None = None  # why versions are READ through host memory (None: not decided, or not)
        self._vram: Memory | None = None  # the device halves' memory while READing from the mirror
        self._vram_handle: Any = None
        self._bounce: torch.Tensor | None = None  # page-locked: each device bucket is copied here to be hashed
        self._device_ok = False  # a READ from the mirror went through: its later failures are not a fallback
        self._words = torch.zeros(2, dtype=torch.int64)  # the slot's (seq, version) as READ after the payload
        self._agent = Agent(reader_name(rid, os.getpid(), secrets.token_hex(4)))
        self._key = keys.nixl_agent(epoch, f"r{rid}")
        try:
            self._agent.register([self._staging, self._words])
            ctl.put(self._key, self._agent.record())
        except BaseException:
            self._agent.close()
            raise
        self._owner: NixlAgentRecord | None = None
        self._tag = 0
        self.lock = threading.Lock()  # the ready half and its version
        self.ready: int | None = None  # the half holding the newest verified version
        self.version: int | None = None
        self._rejected: int | None = None  # the newest version that failed verification: not READ again
        self.failures = Failures(timeout_s)  # in a row; the last one's text, for describe()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"wsync-nixl-read-{rid}", daemon=True)
        self._thread.start()

    # -- the reader's thread ----------------------------------------------------------
    def _run(self) -> None:
        if self._device is not None and torch.cuda.is_available():
            try:
                torch.cuda.set_device(self._device)  # UCX's CUDA transports use this thread's current context
            except RuntimeError as exc:
                log.warning("NIXL reader %d: cannot make %s current in its thread (%s)", self._rid, self._device, exc)
        while not self._stop.is_set():
            newest = self._newest()
            have = max((v for v in (self.version, self._rejected) if v is not None), default=None)
            if newest is None or (have is not None and newest <= have):
                self._stop.wait(_IDLE_POLL_S)
                continue
            try:
                self._fetch(have)
                self.failures.cleared()
            except Torn as exc:
                log.debug("NIXL reader %d: %s; reading again", self._rid, exc)
            except (NixlError, WeightSyncError, RuntimeError) as exc:
                level = self.failures.failed(exc)
                log.log(level, "NIXL reader %d (sender epoch %d): %s", self._rid, self._epoch, exc)
                self._forget_owner()
                self._stop.wait(min(1.0, 0.05 * 2**self.failures.count))

    def _owner_record(self) -> NixlAgentRecord:
        if self._owner is None:
            record = self._ctl.get_record(keys.nixl_agent(self._epoch, "sender"), NixlAgentRecord)
            if record is None:
                raise NotPublished(f"sender epoch {self._epoch} published no NIXL agent")
            regions = record.regions
            slot_sizes = {size for _, size in regions[1:]}
            if len(regions) < 2 or slot_sizes != {self.layout.total_bytes} or regions[0][1] < 4096:
                raise NixlError(f"the sender's NIXL record lists regions {regions!r:.80} that do not fit this layout")
            self._agent.add_remote(record)
            if not self._path_chosen:
                self._choose(record)
            self._owner = record
        return self._owner

    def _choose(self, record: NixlAgentRecord) -> None:
        """READ from the owner's GPU mirror into device halves, or through host memory (said once, with why)."""
        self._path_chosen = True
        why = mirror_refused(self._device, record, self.layout.total_bytes)
        if why is None:
            why = self._stage_on_device()
        if why is None:
            log.info("NIXL reader %d: READing versions from the sender's GPU mirror into %s (device to device)",
                     self._rid, self._device)  # fmt: skip
            return
        self.host_reason = why
        level = logging.INFO if self._device is not None or record.mirror else logging.DEBUG
        log.log(level, "NIXL reader %d: READing versions through host memory: %s", self._rid, why)

    def _stage_on_device(self) -> str | None:
        """Two halves on the module's GPU, registered with this reader's agent; why not, or None."""
        assert self._device is not None
        nbytes = self.layout.total_bytes
        try:
            staging = torch.empty(2 * nbytes, dtype=torch.uint8, device=self._device)
            widest = max((b - a for a, b in self.layout.buckets), default=1)
            bounce = torch.empty(widest, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:  # out of memory, on the device or page-locked
            return f"no room for two device halves on {self._device} ({exc})"
        try:
            self._vram_handle = self._agent.register([staging])
        except NixlError as exc:
            return f"NIXL refused a device buffer on {self._device} ({exc})"
        self._vram = Memory("VRAM", staging.get_device())
        self._bounce = bounce
        with self.lock:
            self.halves = [staging[:nbytes], staging[nbytes:]]
        return None

    def _fall_back(self, why: str) -> None:
        """The mirror's first READ failed: host memory from now on (no version was staged on the device yet)."""
        with self.lock:
            self.halves = self._host_halves
        self._agent.deregister(self._vram_handle)
        self._vram = self._vram_handle = self._bounce = None
        self.host_reason = why
        log.info("NIXL reader %d: READing versions through host memory: %s", self._rid, why)

    def _forget_owner(self) -> None:
        if self._owner is not None:
            self._agent.remove_remote(self._owner.name)
            self._owner = None

    def _fetch(self, have: int | None) -> None:
        owner = self._owner_record()
        grant = self._ask_pin(owner.name, have)
        if grant is None:
            self._stop.wait(_IDLE_POLL_S)  # announced, not yet in the ring (or dropped): look again
            return
        half = 0 if self.ready != 0 else 1
        if grant.slot + 1 >= len(owner.regions):
            raise NixlError(f"the owner granted slot {grant.slot}, which its record does not list")
        into = self.halves[half]
        try:
            self._read(owner, grant, into)
        except NixlError as exc:
            if self._vram is None or self._device_ok:
                raise
            self._fall_back(f"NIXL could not READ the sender's GPU mirror ({exc})")
            return  # read again at once, from host memory
        finally:
            try:
                self._agent.notify(owner.name, messages.unpin(grant.tag))
            except NixlError as exc:
                log.debug("NIXL reader %d: %s", self._rid, exc)
        seq, version = (int(w) for w in self._words.tolist())
        if (seq, version) != (grant.seq, grant.version):
            raise Torn(f"version {grant.version}'s slot moved during the READ (sequence {grant.seq} -> {seq})")
        self._device_ok = self._device_ok or self._vram is not None
        sums = [to_int64(s) for s in self._checksums(into)]
        got = Arrival(grant.version, grant.seq, grant.trailer, sums, None)
        verdict = verify(self._ctl, self.layout, epoch=self._epoch, rid=self._rid, got=got, where=" over NIXL")
        if not verdict.accepted:
            if verdict.reason is not None:
                self._on_rejected(grant.version, verdict.reason)
                self._rejected = grant.version
            return
        with self.lock:
            self.ready, self.version = half, grant.version
        self._on_staged(grant.version)

    def _ask_pin(self, owner: str, have: int | None) -> messages.Grant | None:
        self._tag += 1
        tag = self._tag
        self._agent.notify(owner, messages.pin(tag, have))
        deadline = time.monotonic() + self._timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            for note in self._agent.messages().get(owner, []):
                parsed = messages.parse(note)
                if parsed is None or parsed[1][0] != tag:
                    continue  # an answer to an earlier pin
                if parsed[0] == "N":
                    return None
                grant = messages.as_grant(parsed[1]) if parsed[0] == "G" else None
                if grant is not None:
                    return grant
            time.sleep(0.0005)
        raise NixlError(f"the owner {owner!r} did not answer a pin within timeout_s={self._timeout_s}")

    def _checksums(self, half: torch.Tensor) -> list[int]:
        """Every bucket's xxh3 of ``half``; a device half's buckets are copied to page-locked memory first."""
        if self._bounce is None or not half.is_cuda:
            return bucket_checksums(half, self.layout)
        sums = []
        for a, b in self.layout.buckets:
            self._bounce[: b - a].copy_(half[a:b])  # synchronous: device to page-locked host
            sums.append(checksum(self._bounce, 0, b - a))
        return sums

    def _read(self, owner: NixlAgentRecord, grant: messages.Grant, into: torch.Tensor) -> None:
        local_mem, remote_mem = DRAM, DRAM
        base, size = owner.regions[1 + grant.slot]
        if self._vram is not None:  # the mirror's slot: the same version under the same sequence word
            m = owner.mirror[grant.slot]
            base, size, local_mem, remote_mem = m.address, m.size, self._vram, Memory("VRAM", m.device)
        local = into.data_ptr()
        chunks = [(o, min(self._chunk, size - o)) for o in range(0, size, self._chunk)]
        note = messages.touch(grant.tag)
        pending: list[tuple[Any, float]] = []
        deadline = time.monotonic() + self._timeout_s  # renewed at each completed chunk
        try:
            while chunks or pending:
                while chunks and len(pending) < _WINDOW:
                    o, n = chunks.pop(0)
                    handle = self._agent.post_read(owner.name, [(local + o, n)], [(base + o, n)], note,
                                                   local_mem=local_mem, remote_mem=remote_mem)  # fmt: skip
                    pending.append((handle, 0.0))
                handle = pending[0][0]
                if self._agent.done(handle):
                    self._agent.release(handle)
                    pending.pop(0)
                    deadline = time.monotonic() + self._timeout_s
                    self.after_chunk()
                elif time.monotonic() > deadline or self._stop.is_set():
                    raise NixlError(f"a chunk READ of version {grant.version} made no progress within "
                                    f"timeout_s={self._timeout_s} (the sender stalled or is gone)")  # fmt: skip
                else:
                    time.sleep(0.0002)
            header = owner.regions[0][0]
            words = self._agent.post_read(owner.name, [(self._words.data_ptr(), 16)],
                                          [(header + seq_word_offset(grant.slot), 16)])  # fmt: skip
            pending.append((words, 0.0))
            while not self._agent.done(words):
                if time.monotonic() > deadline or self._stop.is_set():
                    raise NixlError(f"the READ of version {grant.version}'s slot words did not complete")
                time.sleep(0.0002)
        finally:
            for handle, _ in pending:
                self._agent.release(handle)

    def after_chunk(self) -> None:
        """Called after each chunk landed (a seam for tests of a reader slower than the lease)."""

    # -- for the source -------------------------------------------------------------
    def describe(self) -> str:
        failures = self.failures
        plane = "NIXL (device mirror)" if self._vram is not None else "NIXL"
        return plane if failures.count == 0 else f"{plane} (last failure: {failures.last})"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._timeout_s + 1.0)
        if self._thread.is_alive():
            log.warning("NIXL reader %d: its thread did not end within timeout_s; leaving its agent", self._rid)
            return
        try:
            self._ctl.delete(self._key)
        except (WeightSyncError, RuntimeError) as exc:
            log.debug("NIXL reader %d: deleting %r: %s", self._rid, self._key, exc)
        self._agent.close()


class NixlSource(ReceiveSource):
    """A sender epoch's versions as a :class:`NixlReader` stages them, copied into the module."""

    def __init__(self, epoch: int, ordered: list[torch.Tensor], reader: NixlReader) -> None:
        self.epoch = epoch
        self._ordered = ordered
        self.reader = reader

    def apply(self, held: int | None, sums: SumsLookup | None, reject: Reject) -> int | None:
        r = self.reader
        with r.lock:
            if r.ready is None or r.version is None or (held is not None and r.version <= held):
                return None
            half = r.halves[r.ready]
            copy_out(r.layout, half, self._ordered)
            if half.is_cuda:  # device to device, queued: done before the reader may READ into this half again
                with torch.cuda.device(half.device):
                    wait_for_copies()
            return r.version

    def pending_above(self, held: int | None) -> bool:
        r = self.reader
        return r.ready is not None and r.version is not None and (held is None or r.version > held)

    def wait_change(self, until: float, give_up: Callable[[], bool]) -> bool:
        return False  # the reader's on_staged callback wakes the receiver's waiters

    def describe(self) -> str:
        return self.reader.describe()

    def close(self) -> None:
        self.reader.close()
