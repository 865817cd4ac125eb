"""The receiver's end of a network link: a thread that (re)builds its two-rank process
group and stages each version (the sender's end is
:class:`~lightning_wsync._planes.net.sendlink.NetSendLink`).

One process group per (sender epoch, receiver, generation): standalone
``ProcessGroupGloo``/``ProcessGroupNCCL`` objects on a prefix of the shared store, never
the default group (that one belongs to Lightning's DDP), and one per receiver so a
receiver that dies or stalls fails only its own group. After a failure the receiver
takes a new generation and both sides build a fresh group under a new prefix, so
nothing of the broken group can satisfy a wait of the new one.

A version travels as an announcement key on the store, then the message every hop sends
(:mod:`~lightning_wsync._planes.wire`: header, the bytes in pieces of PIECE_BYTES or a
delta, signed trailer). The sender holds a lease on the ring slot for the whole send,
renewed as each piece goes out, so a send is overwritten only when it makes no progress
for the lease. The receiver stages the bytes privately and accepts them only as
:func:`~lightning_wsync._planes.wire.verify` says.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch
import xxhash

from lightning_wsync._control import keys
from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.store import Control
from lightning_wsync._control.untrusted import unexpected
from lightning_wsync._planes.delta.wire import Held, held_of, ready_note, recv_records
from lightning_wsync._planes.net.notes import PIECE_BYTES, NoteWaiter, forget_notes
from lightning_wsync._planes.wire import (
    DELTA,
    HEADER_WORDS,
    Arrival,
    Header,
    Interruptible,
    PeerGroup,
    make_group,
    pieces,
    shutdown_group,
    to_int64,
    trailer_words,
    verify,
)
from lightning_wsync.errors import WeightSyncRecordError, WeightSyncStoreError

log = logging.getLogger(__name__)

_SILENCE_CHECK_S = 0.25  # how often a waiting receiver looks (locally) for silence past timeout_s
_REBUILD_PAUSE_S = 0.1  # between a failed group and the next (a peer refusing at once would spin)
_STORE_RETRY_S = 1.0


class LinkSilent(Exception):
    """The peer wrote no announcement within ``timeout_s`` while a newer version was out."""


class NetReceiveLink:
    """The receiver's side: a thread that (re)builds its group and stages each version."""

    def __init__(
        self,
        control: Control,
        layout: Manifest,
        *,
        epoch: int,
        rid: int,
        backend: str,
        addr: str,
        timeout_s: float,
        device: torch.device,
        on_staged: Callable[[int], None],
        on_rejected: Callable[[int, str], None],
        newest: Callable[[], int | None] = lambda: None,
        pinned: bool = False,
    ) -> None:
        self.layout = layout
        self.device = device
        # Staging in page-locked memory (a module on a GPU, receiving over gloo): the apply
        # is then one DMA copy per tensor (55 GB/s on an H200 against 7-9 from pageable).
        self._pinned = pinned
        self._pieces = pieces(layout.buckets, PIECE_BYTES)
        # Touched now, not mid-receive; None after take_staged() handed it over unreplaced.
        self.staging: torch.Tensor | None = self._new_staging()
        self.lock = threading.Lock()  # held while staging is being applied
        self.staged_version: int | None = None
        self.epoch = epoch
        self._control = control
        self._rid = rid
        self._backend = backend
        self._addr = addr
        self._timeout_s = timeout_s
        self._on_staged = on_staged
        self._on_rejected = on_rejected
        self._taken = threading.Event()  # update() took the staged version
        self._hold_s = 0.0  # how long a staged version waits for update() before the next receive
        # The newest version this side holds intact (a delta's base) and the buffer holding
        # it: the staging buffer, or in swap mode the one handed to the module.
        self._held: Held | None = None
        self._held_buffer: torch.Tensor | None = None
        self._decode_s: float | None = None
        self._newest = newest  # the newest version published, as the watcher last read it
        self._seen: int | None = None  # the newest version whose header arrived, on any generation
        self._n = 0  # the announcement the current generation waits for
        self._number = 0  # the last link number taken (member/<rid>/net)
        self._pg: Interruptible | None = None
        self._stop = threading.Event()
        self._notes = NoteWaiter(control, self._stop)
        self._thread = threading.Thread(target=self._run, name=f"wsync-recv-net-r{rid}", daemon=True)
        self._thread.start()
        self._quiet = threading.Thread(target=self._watch_silence, name=f"wsync-recv-net-quiet-r{rid}", daemon=True)
        self._quiet.start()

    def _new_staging(self) -> torch.Tensor:
        return torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=self.device, pin_memory=self._pinned)

    def take_staged(
        self, held: int | None, spare: torch.Tensor | None, bind: Callable[[torch.Tensor], None]
    ) -> int | None:
        """Swap mode: ``bind`` the staged buffer (if newer than ``held``) and stage the next in ``spare``.

        ``spare`` is the buffer the module viewed until now; None: the link allocates one
        before its next receive. Returns the version handed over.
        """
        with self.lock:  # the next receive cannot start into `spare` before `bind` has run
            staged, buffer = self.staged_version, self.staging
            if staged is None or buffer is None or (held is not None and staged <= held):
                return None
            bind(buffer)
            self.staging, self.staged_version = spare, None
            self._taken.set()
            return staged

    def take(self, apply: Callable[[torch.Tensor], None], held: int | None) -> int | None:
        """Copy mode: ``apply`` the staged buffer if its version is above ``held``; return that version."""
        with self.lock:
            staged, buffer = self.staged_version, self.staging
            if staged is None or buffer is None or (held is not None and staged <= held):
                return None
            apply(buffer)
            self._taken.set()
            return staged

    def pending_above(self, held: int | None) -> bool:
        staged = self.staged_version
        return staged is not None and (held is None or staged > held)

    def _run(self) -> None:
        ctl = self._control.clone()
        while not self._stop.is_set():
            try:
                number = self._number = ctl.add(keys.member_link(self._rid), 1)
                ctl.bump(keys.LINKS_ASKED)  # the sender looks at link numbers when this moves
            except WeightSyncStoreError:  # the watcher reports it; the link comes back with the store
                self._stop.wait(_STORE_RETRY_S)
                continue
            except Exception as exc:  # noqa: BLE001 - a link thread that died would bring no version again
                unexpected(log, self._thread.name, exc)
                if isinstance(exc, WeightSyncRecordError):  # its own counter garbled (a store writer): renumbered
                    try:
                        ctl.set_text(keys.member_link(self._rid), str(self._number))
                    except WeightSyncStoreError:
                        pass  # the store is gone: the next add says so
                self._stop.wait(_STORE_RETRY_S)
                continue
            prefix = keys.link_prefix(self.epoch, self._rid, number)
            pg: Interruptible | None = None
            self._n = 0
            try:
                pg = self._pg = Interruptible(make_group(self._backend, ctl.prefix_store(prefix), 1, self._addr,
                                                         self._timeout_s), self._backend)  # fmt: skip
                self._serve(pg, ctl, prefix)
            except Exception as exc:  # noqa: BLE001 - rebuild the group and go on
                if not self._stop.is_set():
                    log.info("network link %d ended (%s); rebuilding", number, str(exc).strip()[:200])
                    self._stop.wait(_REBUILD_PAUSE_S)
            finally:
                shutdown_group(pg)
                forget_notes(ctl, prefix, self._n)
                for key in keys.group_keys(prefix):  # spent, or never to be joined
                    ctl.delete(key)

    def _watch_silence(self) -> None:
        """End a wait for an announcement once it is silent (see :meth:`_silent`): looked at
        here, in memory, so a link waiting at idle sends the store nothing."""
        while not self._stop.wait(_SILENCE_CHECK_S):
            since = self._notes.waiting_since
            try:
                if since is not None and self._silent(time.monotonic() - since):
                    self._notes.wake()
            except Exception as exc:  # noqa: BLE001 - a link left waiting on a silent sender never comes back
                unexpected(log, self._quiet.name, exc)

    def _silent(self, waited_s: float) -> bool:
        """No announcement for ``timeout_s`` although a version newer than any seen here is
        published: the sender's end of this link is gone (it failed, or dropped the link
        while this process was paused), and only a new group brings versions again."""
        if waited_s < self._timeout_s:
            return False
        newest = self._newest()
        return newest is not None and (self._seen is None or newest > self._seen)

    def _serve(self, pg: PeerGroup, ctl: Control, prefix: str) -> None:
        device = self.device
        nb = len(self.layout.buckets)
        n = 0
        while not self._stop.is_set():
            self._n = n
            if self.staged_version is not None:
                # Keep the staged version for update() for up to one receive time: under
                # pushes faster than a send, each version received is then applied.
                self._taken.wait(self._hold_s)
            held = self._held if self._held_buffer is not None and self.device.type != "cuda" else None
            ctl.set_text(keys.ready(prefix, n), ready_note(held, self._decode_s))
            ann = keys.announcement(prefix, n)
            waiting_since = time.monotonic()
            while not self._notes.wait(ctl, ann):  # False: the backstop passed, stop, or silence (a wake)
                if self._stop.is_set():
                    return
                if self._notes.woken or self._silent(time.monotonic() - waiting_since):
                    raise LinkSilent(f"no version announced within timeout_s={self._timeout_s} while version "
                                     f"{self._newest()} is published (newest seen here: {self._seen})")  # fmt: skip
            ctl.delete(ann)  # one key per push would otherwise pile up in the store's memory
            head = torch.empty(HEADER_WORDS, dtype=torch.int64, device=device)
            pg.recv([head], 0, 0).wait()
            header = Header.unpack(head)
            version = header.version
            self._seen = version if self._seen is None else max(self._seen, version)
            header.check(self.layout.total_bytes, len(self._pieces), nb)
            with self.lock:  # waits for an update() that is copying the previous version out
                self.staged_version = None
                staging = self.staging
            if staging is None:  # handed to the module by take_staged(); no update() touches it now
                staging = self.staging = self._new_staging()
            started = time.monotonic()
            base, base_held = self._held_buffer, self._held
            if staging is base:  # rewritten in place from here on: no longer a base
                self._held = self._held_buffer = None
            sums, delta_error = self._receive(pg, header, staging, base, base_held)
            trailer = torch.empty(trailer_words(nb), dtype=torch.int64, device=device)
            pg.recv([trailer], 0, 0).wait()
            n += 1
            got = Arrival(version, header.seq, trailer.cpu().tolist(), None if staging.is_cuda else sums, delta_error)
            verdict = verify(ctl, self.layout, epoch=self.epoch, rid=self._rid, got=got)
            if not verdict.accepted:
                if verdict.reason is not None:
                    self._on_rejected(version, verdict.reason)
                continue
            with self.lock:
                self.staged_version = version
                self._taken.clear()
            if verdict.sums is not None:
                self._held, self._held_buffer = held_of(version, verdict.sums), staging
            self._hold_s = time.monotonic() - started
            self._on_staged(version)

    def _receive(
        self, pg: PeerGroup, header: Header, staging: torch.Tensor, base: torch.Tensor | None, held: Held | None
    ) -> tuple[list[int], str | None]:
        """The version's bytes into ``staging``: their checksums (CPU only), and why a delta was not rebuilt."""
        if header.kind == DELTA:
            got = recv_records(pg, self.layout, held=held, base=base, out=staging)
            self._decode_s = got.stats.decode_s
            return got.sums or [], got.error
        sums: list[int] = []
        works = [pg.recv([staging[a:b]], 0, 0) for a, b, _ in self._pieces]
        hasher = None if staging.is_cuda else xxhash.xxh3_64()
        for (a, b, bucket), work in zip(self._pieces, works):
            work.wait()
            if hasher is None:
                continue
            # Each piece is hashed as it lands, still in the cache the kernel's copy left it
            # in (a bucket hashed once all of it is in is read back from memory: 0.07 against
            # 0.11 CPU-s/GB here, docs/benchmarks.md). xxh3 streamed equals xxh3 in one go.
            hasher.update(staging[a:b].numpy().data)
            if b == self.layout.buckets[bucket][1]:
                sums.append(to_int64(hasher.intdigest()))
                hasher.reset()
        return sums, None

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._notes.wake()
        pg = self._pg
        if pg is not None:
            pg.interrupt()  # a receive waiting for a stalled sender ends now (one partly read: at timeout_s)
        self._thread.join(timeout=timeout_s)
        self._quiet.join(timeout=timeout_s)
