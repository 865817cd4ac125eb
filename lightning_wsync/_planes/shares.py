"""A trainer rank's (other than 0) ring of its share of a sharded push (see docs/sharded.md).

Every trainer rank makes the same :class:`~lightning_wsync._control.shards.Shares`
(:func:`~lightning_wsync._push.shares.prepare_shares`). Rank 0 hands its part to its
sender, whose ring then holds only rank 0's share; every other rank keeps a
:class:`ShareWriter`: a ring of its own share in shared memory, written at each push.
Receivers on the host read every rank's ring and apply a version only when all of them hold
it complete; across hosts each rank relays its ring's versions down a chain (or two trees) of its own
(:meth:`ShareWriter.relay`, docs/sharded.md). Callers open it through
:func:`lightning_wsync._planes.open.open_share_writer`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import torch
import torch.distributed as dist

from lightning_wsync._control import keys
from lightning_wsync._control.host import local_address
from lightning_wsync._control.records import SenderRecord
from lightning_wsync._control.shards import Shares
from lightning_wsync._control.signing import resolve_secret
from lightning_wsync._control.store import Control, connect_store, resolve_job
from lightning_wsync._control.timing import timing
from lightning_wsync._planes.relay.head.streams import StreamHead, relays_streams
from lightning_wsync._planes.shm import cuda_ipc
from lightning_wsync._planes.shm.ring import SnapshotRing
from lightning_wsync._planes.shm.segment import ShmSegment, remove_stale_segments, segment_name
from lightning_wsync.config import SenderConfig
from lightning_wsync.errors import WeightSyncError, WeightSyncStoreError

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0  # ShareWriter.close: its relay's threads, all of them

_SERIALS = itertools.count(10**12)  # a share ring's name: wsync-<pid>-<serial>-<job>, never a sender epoch


class ShareWriter:
    """A trainer rank's (other than 0) ring of its share, in shared memory."""

    def __init__(self, shares: Shares, config: SenderConfig) -> None:
        job = resolve_job(config.job, "WeightSyncCallback")
        remove_stale_segments()
        self._shares = shares
        self.segment = ShmSegment(segment_name(job, next(_SERIALS)), shares.share.total_bytes, create=True, slots=2)
        self._timing = timing(heartbeat_timeout_s=config.heartbeat_timeout_s, timeout_s=config.timeout_s)
        mirror = cuda_ipc.mirror_device(shares.sources, "WeightSyncCallback") if config.cuda_ipc else None
        self._ring = SnapshotRing(shares.share, segment=self.segment, device=torch.device("cpu"), slots=2,
                                  lease_s=self._timing.pin_lease_s, mirror=mirror)  # fmt: skip
        self.stall_s: float | None = None  # the last write's
        self._stream: StreamHead | None = None  # across hosts: this rank's relay of its share
        self._closed_key: str | None = None  # rank 0's sender's, once relaying
        self._sums: _SumsNotes | None = None  # on another host than rank 0: each share's checksums, for rank 0
        log.info("trainer rank %d writes its share of each version (%.1f MiB of %.1f MiB) into %s", shares.rank,
                 shares.share.total_bytes / 2**20, shares.layout.total_bytes / 2**20, self.segment.name)  # fmt: skip

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def dropped(self) -> int:
        return self._ring.dropped

    def write(self, version: int, *, wait_for_slot_s: float = 0.0) -> bool:
        """Snapshot this rank's share as ``version``; False when every slot was being read (dropped)."""
        started = time.perf_counter()
        written = self._ring.write(version, self._shares.sources, wait_s=wait_for_slot_s, wake=False)
        self.stall_s = time.perf_counter() - started
        if written is not None:
            self._ring.wake_readers()
            if self._stream is not None:
                self._stream.wrote(version)
            if self._sums is not None:
                self._sums.wrote(version)
        return written is not None

    def relay(self, store: dist.Store | str | None, epoch: int, config: SenderConfig) -> None:
        """Relay this rank's share to other hosts (its own chain or trees, :class:`StreamHead`) for sender
        ``epoch``, when the settings relay (``transport='auto'`` or ``'nixl'``, ``cross_host`` other than ``'star'``).

        ``store``: the callback's, or rank 0's ``host:port`` (it may have picked the port).
        """
        if not relays_streams(config.transport, config.cross_host) or self._stream is not None:
            return
        handle = connect_store(store, serve=False, timeout_s=config.timeout_s, owner="WeightSyncCallback")
        ctl = Control(handle.store, resolve_job(config.job, "WeightSyncCallback"),
                      resolve_secret(config.secret, "WeightSyncCallback"))  # fmt: skip
        self._closed_key = keys.closed(epoch)
        self._stream = StreamHead(
            ctl, self._ring, stream=keys.relay_stream(epoch, self._shares.rank),
            written_key=keys.shard_written(epoch, self._shares.rank), backend="gloo",
            addr=local_address(handle.address), timing=self._timing, delta=config.delta, topology=config.cross_host,
            nixl=config.transport == "nixl", job=ctl.job,
        )  # fmt: skip
        sender = ctl.get_record(keys.sender_record(epoch), SenderRecord)  # published before epoch reached us
        if sender is not None and sender.host != self._shares.host:  # rank 0 cannot read this ring: it reads
            self._sums = _SumsNotes(ctl.clone(), self._ring, keys.shard_sums(epoch, self._shares.rank))  # these
        log.info("trainer rank %d relays its share of sender epoch %d to other hosts", self._shares.rank, epoch)

    def close(self, flush_timeout_s: float = 0.0, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop relaying and free the ring; with ``flush_timeout_s``, first wait (at most that long) for
        rank 0's sender to close: it waits for the last push's delivery, which may still need this share.
        The threads that relay the share (the checksum notes', the stream head's, its feed's, its
        encoders') are waited for within one ``timeout_s`` in all, not one bound each (the flush
        wait has its own)."""
        stream, self._stream = self._stream, None
        sums, self._sums = self._sums, None
        started = time.monotonic()
        if sums is not None:
            sums.close(timeout_s)
        spent = time.monotonic() - started  # of the one bound (the flush wait below has its own)
        if stream is not None:
            if flush_timeout_s > 0 and self._closed_key is not None:
                try:
                    stream.ctl.clone().wait_for(self._closed_key, flush_timeout_s, private=False)  # rank 0's record
                except WeightSyncError as exc:  # the store went with rank 0: nothing left to wait for
                    log.debug("trainer rank %d: %s", self._shares.rank, exc)
            stream.close(max(0.0, timeout_s - spent))
        self._ring.close()
        self.segment.close()


class _SumsNotes:
    """On a thread of its own (never the training loop): the bucket checksums of each share this rank
    wrote, noted on the store for rank 0, which publishes every rank's for receivers that verify across
    hosts (docs/sharded.md). The newest version only: one rank 0 missed is published without them."""

    def __init__(self, ctl: Control, ring: SnapshotRing, key: str) -> None:
        self._ctl, self._ring, self._key = ctl, ring, key
        self._cond = threading.Condition()
        self._pending: int | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="wsync-share-sums", daemon=True)
        self._thread.start()

    def wrote(self, version: int) -> None:
        with self._cond:
            self._pending = version
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._stopped)
                if self._stopped:
                    return
                version, self._pending = self._pending, None
            assert version is not None
            ref = self._ring.find(version)
            lease = None if ref is None else self._ring.acquire(ref)
            if lease is None:
                continue  # overwritten already: a newer version is pending
            try:
                sums = self._ring.checksums(lease)
            finally:
                lease.release()
            if sums is None:
                continue
            try:
                self._ctl.set_json(self._key, {"version": version, "sums": sums})
            except WeightSyncStoreError as exc:  # the store went with rank 0: nobody reads them
                log.debug("share checksums of version %d not noted: %s", version, exc)

    def close(self, timeout_s: float) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=timeout_s)
        try:
            self._ctl.delete(self._key)
        except WeightSyncError as exc:
            log.debug("share checksums key not deleted: %s", exc)
