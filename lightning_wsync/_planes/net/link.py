"""Cross-host data plane: one two-rank process group per (sender epoch, receiver, generation).

Groups are standalone ``ProcessGroupGloo``/``ProcessGroupNCCL`` objects on a prefix of
the shared store, never the default group (that one belongs to Lightning's DDP), and
one per receiver so a receiver that dies or stalls fails only its own group. After a
failure the receiver takes a new generation and both sides build a fresh group under
a new prefix, so nothing of the broken group can satisfy a wait of the new one.

A version travels as an announcement key on the store, then the message every hop sends
(:mod:`~lightning_wsync._planes.wire`: header, the bytes in pieces of PIECE_BYTES or a
delta, signed trailer). The sender holds a lease on the ring slot for the whole send,
renewed as each piece goes out, so a send is overwritten only when it makes no progress
for the lease. The receiver stages the bytes privately and accepts them only as
:func:`~lightning_wsync._planes.wire.verify` says.

Longer than 300 lines: both ends of a link, one protocol, read side by side.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from lightning_wsync._control import keys
from lightning_wsync._control.manifest import Manifest, checksum
from lightning_wsync._control.store import Control
from lightning_wsync._control.untrusted import unexpected
from lightning_wsync._planes.delta.encode import AutoPolicy, DeltaStream, DeltaStreams, delta_base
from lightning_wsync._planes.delta.wire import Held, held_of, parse_ready_note, ready_note, recv_records, send_delta
from lightning_wsync._planes.shm.ring import Lease, SnapshotRing
from lightning_wsync._planes.wire import (
    DELTA,
    FULL,
    HEADER_WORDS,
    Arrival,
    Header,
    Interruptible,
    PeerGroup,
    make_group,
    pieces,
    shutdown_group,
    signed_trailer,
    to_int64,
    trailer_words,
    verify,
)
from lightning_wsync.errors import WeightSyncStoreError

log = logging.getLogger(__name__)

_WAIT_BACKSTOP_S = 60.0  # longest wait on the store for a note; stop and silence end one sooner
_SILENCE_CHECK_S = 0.25  # how often a waiting receiver looks (locally) for silence past timeout_s
_REBUILD_PAUSE_S = 0.1  # between a failed group and the next (a peer refusing at once would spin)
_STORE_RETRY_S = 1.0
PIECE_BYTES = 1 << 20  # a full version's unit on the wire: the sender's lease is renewed after each


class NoteWaiter:
    """A link thread's waits for its peer's notes: one blocking store wait per note, not a
    poll every few milliseconds, and :meth:`wake` to end a wait early.

    The thread waits on its own connection (a clone); :meth:`wake` writes the awaited key
    through the owner's, so ``stop()`` ends the wait at once, and so does a receiver's
    silence watch (:meth:`NetReceiveLink._watch_silence`). The key is the link's own (its
    prefix and number) and is deleted with its other notes. ``backstop_s`` bounds a
    wait whose wake-up was lost (the store logs a line when a wait times out: rare, on purpose).
    """

    def __init__(self, control: Control, stop: threading.Event, backstop_s: float = _WAIT_BACKSTOP_S) -> None:
        self._control = control
        self._stop = stop
        self._backstop_s = backstop_s
        self._lock = threading.Lock()  # a wake is written only into a wait in progress
        self._key: str | None = None
        self._woken = False
        self.waiting_since: float | None = None  # set while the thread is in a wait

    def wait(self, ctl: Control, key: str) -> bool:
        """True once the peer wrote ``key``; False after the backstop, on stop, or on a wake."""
        with self._lock:
            self._key, self._woken = key, False
            self.waiting_since = time.monotonic()
        try:
            if self._stop.is_set():  # after waiting_since is set: a stop() later than this wakes the wait
                return False
            return ctl.wait_for(key, self._backstop_s) and not (self._stop.is_set() or self._woken)
        finally:
            with self._lock:
                self.waiting_since = None

    @property
    def woken(self) -> bool:
        """The last wait was ended by :meth:`wake` (its key now holds the wake, not a note)."""
        return self._woken

    def wake(self) -> None:
        """End the wait in progress, if any, by writing its key (deleted with the link's notes:
        the wait cannot return, nor the thread delete its notes, before this write is done)."""
        with self._lock:
            if self.waiting_since is None or self._key is None:
                return
            self._woken = True
            try:
                self._control.set_text(self._key, "wake")
            except WeightSyncStoreError:
                pass  # the store is gone: the wait fails by itself


class LinkSilent(Exception):
    """The peer wrote no announcement within ``timeout_s`` while a newer version was out."""


class NetSendLink:
    """The sender's side of one receiver's group: a thread that sends each new version."""

    def __init__(
        self,
        control: Control,
        ring: SnapshotRing,
        *,
        epoch: int,
        rid: int,
        number: int,
        backend: str,
        addr: str,
        timeout_s: float,
        deltas: DeltaStreams | None = None,
        policy: AutoPolicy | None = None,
    ) -> None:
        self.rid = rid
        self.number = number  # the link number (member/<rid>/net) this link serves
        self.error: str | None = None
        self.sent_version: int | None = None
        self.superseded = 0  # sends whose slot was overwritten under them (a stall past the lease)
        self.delta_versions: dict[int, float | None] = {}  # version sent as a delta -> receiver's decode_s
        self._control = control
        self._ring = ring
        self._deltas = deltas
        self._policy = policy or AutoPolicy("off")
        self._held: Held | None = None  # what the receiver said it holds before this send
        self._epoch = epoch
        self._backend = backend
        self._addr = addr
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._notes = NoteWaiter(control, self._stop)
        self._pg: Interruptible | None = None
        self._leases: list[Lease] = []  # held for the send in progress; let go on stop()
        self._leases_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"wsync-send-r{rid}l{number}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ctl = self._control.clone()
        prefix = keys.link_prefix(self._epoch, self.rid, self.number)
        pg: Interruptible | None = None
        n = 0
        try:
            pg = self._pg = Interruptible(make_group(self._backend, ctl.prefix_store(prefix), 0, self._addr,
                                                     self._timeout_s), self._backend)  # fmt: skip
            if self._stop.is_set():
                return
            while not self._stop.is_set():
                # The receiver says when its staging buffer is free: a send it cannot keep
                # until update() takes it would only be overwritten by the next.
                ready = keys.ready(prefix, n)
                while not self._notes.wait(ctl, ready):  # False: the backstop passed, or stop
                    if self._stop.is_set():
                        return
                self._held, decode_s = parse_ready_note(ctl.get_text(ready))
                if self.sent_version in self.delta_versions:
                    self.delta_versions[self.sent_version] = decode_s
                ctl.delete(ready)
                # The newest version, held until it is all out: a push meanwhile goes to the
                # other slot, so a link always finishes what it started.
                lease = None
                while lease is None and not self._stop.is_set():
                    lease = self._ring.acquire_newer(self.sent_version, 0.2)
                if lease is None or not self._hold(lease):
                    return
                try:
                    self._send(pg, ctl, keys.announcement(prefix, n), lease)
                finally:
                    self._let_go(lease)
                n += 1
        except Exception as exc:  # noqa: BLE001 - any failure ends this link only
            if not self._stop.is_set():
                text = str(exc).strip()
                error = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
                if "timed out" in text.lower():  # the receiver took no bytes for timeout_s: stalled or slow
                    error = f"no progress within timeout_s={self._timeout_s} (stalled or slow receiver; {error})"
                self.error = error
                log.warning("link %d to receiver rid=%d failed: %s", self.number, self.rid, self.error)
        finally:
            shutdown_group(pg)
            # Unreferenced, the group closes its connection: a receiver blocked in a receive
            # on it fails at once (when it runs again) instead of at its own timeout_s.
            self._pg = pg = None
            forget_notes(ctl, prefix, n)

    def _hold(self, lease: Lease) -> bool:
        """Keep ``lease`` where stop() lets go of it; False (released) once stopped."""
        with self._leases_lock:
            if not self._stop.is_set():
                self._leases.append(lease)
                return True
        lease.release()
        return False

    def _let_go(self, lease: Lease) -> None:
        with self._leases_lock:
            if lease in self._leases:
                self._leases.remove(lease)
        lease.release()

    def _send(self, pg: PeerGroup, ctl: Control, ann_key: str, lease: Lease) -> None:
        delta = delta_base(self._ring, self._deltas, self._policy, self._held, lease, f"rid={self.rid}")
        if delta is not None and not self._hold(delta[1]):
            return  # stopped meanwhile: the base is let go, and the thread ends
        try:
            self._send_version(pg, ctl, ann_key, lease, delta)
        finally:
            if delta is not None:  # whatever failed: a leaked lease would pin the base slot for lease_s
                self._let_go(delta[1])

    def _send_version(
        self, pg: PeerGroup, ctl: Control, ann_key: str, lease: Lease, delta: tuple[DeltaStream, Lease] | None
    ) -> None:
        layout = self._ring.layout
        buffer, (_, seq, version) = lease.buffer, lease.ref
        device = buffer.device
        ctl.set_text(ann_key, str(version))
        wire = pieces(layout.buckets, PIECE_BYTES)
        kind, count = (FULL, len(wire)) if delta is None else (DELTA, len(layout.buckets))
        pg.send([Header(version, seq, layout.total_bytes, count, kind).tensor().to(device)], 1, 0).wait()
        if delta is None:
            works = [pg.send([buffer[a:b]], 1, 0) for a, b, _ in wire]
            # Hash while gloo streams the pieces (computed once per version for all links).
            sums = self._ring.checksums(lease) if not buffer.is_cuda else [0] * len(layout.buckets)
            for work in works:
                work.wait()
                lease.touch()
        else:
            stream, base = delta
            sums = send_delta(pg, self._ring, lease, stream, base, f"r{self.rid}")
            self._policy.observe(version, stream.stats())
            self.delta_versions[version] = None
            while len(self.delta_versions) > 8:
                del self.delta_versions[min(self.delta_versions)]
        intact = sums is not None and lease.intact()
        if not intact:
            self.superseded += 1
        trailer = signed_trailer(ctl, self._epoch, self.rid, version, seq, sums, intact=intact,
                                 buckets=len(layout.buckets))  # fmt: skip
        pg.send([trailer.to(device)], 1, 0).wait()
        self.sent_version = version
        log.debug("sent version %d to rid=%d (%s)", version, self.rid, "intact" if intact else "superseded")

    def stop(self) -> None:
        """Ask the thread to end, end a send it is blocked in (see :meth:`join`), and let go
        of the ring slots it holds at once.

        A send to a receiver that died mid-version can stay blocked until gloo's own
        ``timeout_s`` (the interrupt does not always end it); its leases would keep both
        snapshot slots from the next push meanwhile, which is then dropped. Released
        here, a slot rewritten under the send only makes its trailer say "superseded".
        """
        with self._leases_lock:
            self._stop.set()
            leases, self._leases = self._leases, []
        for lease in leases:
            lease.release()
        self._notes.wake()
        pg = self._pg
        if pg is not None:
            pg.interrupt()

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the thread to end; True when it has."""
        self._thread.join(timeout=max(0.0, timeout_s))
        if self._thread.is_alive() and self._pg is not None:
            self._pg.interrupt()  # it had not reached its first wait when stop() came
            self._thread.join(timeout=0.05)
        return not self._thread.is_alive()

    def close(self, timeout_s: float = 5.0) -> None:
        self.stop()
        self.join(timeout_s)


def forget_notes(ctl: Control, prefix: str, n: int) -> None:
    """Delete what a link that ended at its ``n``-th version may have left on the store."""
    for key in (keys.ready(prefix, n), keys.announcement(prefix, n)):
        ctl.delete(key)


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
                number = ctl.add(keys.member_link(self._rid), 1)
                ctl.bump(keys.LINKS_ASKED)  # the sender looks at link numbers when this moves
            except WeightSyncStoreError:  # the watcher reports it; the link comes back with the store
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
        for (_, b, bucket), work in zip(self._pieces, works):
            work.wait()
            start, end = self.layout.buckets[bucket]
            if b == end and not staging.is_cuda:  # hash bucket i while bucket i+1 arrives
                sums.append(to_int64(checksum(staging, start, end)))
        return sums, None

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._notes.wake()
        pg = self._pg
        if pg is not None:
            pg.interrupt()  # a receive blocked on a stalled sender ends now, not at timeout_s
        self._thread.join(timeout=timeout_s)
        self._quiet.join(timeout=timeout_s)
