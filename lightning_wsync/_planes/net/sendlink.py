"""The sender's end of a network link: one two-rank process group per (sender epoch,
receiver, generation), a thread that sends each new version from its ring slot.

Groups are standalone ``ProcessGroupGloo``/``ProcessGroupNCCL`` objects on a prefix of
the shared store, never the default group (that one belongs to Lightning's DDP), and
one per receiver so a receiver that dies or stalls fails only its own group. The
receiver's end is :class:`~lightning_wsync._planes.net.link.NetReceiveLink`.

A version travels as an announcement key on the store, then the message every hop sends
(:mod:`~lightning_wsync._planes.wire`: header, the bytes in pieces of PIECE_BYTES or a
delta, signed trailer). The sender holds a lease on the ring slot for the whole send,
renewed as each piece goes out, so a send is overwritten only when it makes no progress
for the lease.
"""

from __future__ import annotations

import logging
import threading

from lightning_wsync._control import keys
from lightning_wsync._control.store import Control
from lightning_wsync._planes.delta.encode import AutoPolicy, DeltaStream, DeltaStreams, delta_base
from lightning_wsync._planes.delta.wire import Held, parse_ready_note, send_delta
from lightning_wsync._planes.net.notes import PIECE_BYTES, NoteWaiter, forget_notes
from lightning_wsync._planes.shm.ring import Lease, SnapshotRing
from lightning_wsync._planes.wire import (
    DELTA,
    FULL,
    Header,
    Interruptible,
    PeerGroup,
    make_group,
    pieces,
    shutdown_group,
    signed_trailer,
)

log = logging.getLogger(__name__)


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
