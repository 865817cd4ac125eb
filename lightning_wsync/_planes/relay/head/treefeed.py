"""The sender's side of a tree topology: half of every version to each tree's root.

See :mod:`~lightning_wsync._planes.relay.plan` for the shape. Each root's hop is a
two-rank group of its own under ``relay/<epoch>/pg/<number>/t<tree>/<rid>/``; both get
a header (the version, its snapshot sequence, how many chunks follow), their half of the
chunks, in full or as a delta against what that root holds
(:mod:`~lightning_wsync._planes.relay.treedelta`), and the same signed trailer. A root whose hop fails is marked broken
and the sender re-forms the trees without it (as for the chain's first leader).

A topology change mid-version ends the feed at once, and the head resends the newest
version to the new roots. The feed does not wait for a send under way to end: a gloo send
whose bytes are partly written to a root that stopped reading (it left the old topology)
is woken by nothing, not an interrupt, not the pair's closing, until the group timeout
(measured), and the new trees would get the newest version only timeout_s later, or
never when a newer one was pushed meanwhile. So each version is sent by a thread of its
own, which the feed leaves behind when the topology changes (its hops are interrupted and
closed: what is left of it ends on its own within timeout_s, and releases its slot).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from lightning_wsync._control import keys
from lightning_wsync._control.store import Control
from lightning_wsync._planes.delta.encode import AutoPolicy, DeltaStream, DeltaStreams, delta_base
from lightning_wsync._planes.delta.wire import Held
from lightning_wsync._planes.relay.hops import (
    RELAY_RID,
    Chain,
    Stream,
    Superseded,
    chunks,
    error_text,
    hop_header,
    join_hop,
    mark_broken,
    next_lease,
    send_apart,
    wait_ready,
)
from lightning_wsync._planes.relay.plan import TREES, half, roots
from lightning_wsync._planes.relay.tidy import forget_hop
from lightning_wsync._planes.relay.treedelta import chunk_layout, half_messages, send_halves
from lightning_wsync._planes.shm.ring import Lease, SnapshotRing
from lightning_wsync._planes.wire import DELTA, FULL, Interruptible, close_group, signed_trailer

log = logging.getLogger(__name__)


class TreeFeed:
    """One tree topology (one chain number) as the sender feeds it."""

    def __init__(
        self, ctl: Control, ring: SnapshotRing, chain: Chain, stream: Stream, *, superseded: Callable[[], bool],
        deltas: DeltaStreams | None = None, policy: AutoPolicy | None = None,
    ) -> None:  # fmt: skip
        """``deltas`` (the sender's, with ``policy``): each root gets its half as a delta
        against what it holds, when ``delta_base`` says so, its records cut by chunk."""
        self._ctl = ctl
        self._ring = ring
        self._epoch = epoch = stream.number
        self._backend = stream.backend
        self._addr = stream.addr
        self._timeout_s = stream.timeout_s
        self._superseded = superseded
        self._pieces = chunks(ring.layout)
        self._deltas = deltas
        self._policy = policy or AutoPolicy("off")
        self._cuts = chunk_layout(ring.layout)
        self._halves = [half(len(self._pieces), t) for t in range(TREES)]
        self.roots = roots(chain.rids)
        self._prefixes = [keys.relay_hop_prefix(epoch, chain.number, self.roots[t], t) for t in range(TREES)]
        self._pgs: list[Interruptible | None] = [None] * TREES
        self._blame = 0  # the tree whose root the step under way depends on
        self._notes = 0

    def run(self) -> bool:
        """Feed both roots until the topology changes; True when a root's hop failed (it was marked broken)."""
        ctl = self._ctl
        try:
            for t in range(TREES):
                self._blame = t
                pg = join_hop(ctl, self._prefixes[t], 0, self._backend, self._addr, self._timeout_s, self._superseded)
                self._pgs[t] = Interruptible(pg, self._backend)
                log.debug("relay: tree %d's root rid=%d joined", t, self.roots[t])
            self._feed()
            return False
        except Superseded:
            return False
        except Exception as exc:  # noqa: BLE001 - this root only; the trees are re-formed
            if self._superseded():
                return False
            rid = self.roots[self._blame]
            log.warning("relay: hop to tree %d's root rid=%d failed: %s", self._blame, rid, error_text(exc))
            mark_broken(ctl, self._epoch, rid)
            return True
        finally:
            for t in range(TREES):
                close_group(self._pgs[t], 1, self._backend)  # a root waiting on this hop is released now
                forget_hop(ctl, self._prefixes[t], 0, spent=self._pgs[t] is not None, notes=(self._notes,))
            self._pgs = [None] * TREES  # freed: an aborted group keeps its sockets open until then

    def _feed(self) -> None:
        sent: int | None = None
        n = 0
        if self._deltas is not None:
            self._deltas.prepare(self._cuts)
        while not self._superseded():
            held: list[Held | None] = []
            for t in range(TREES):
                self._blame = t
                held.append(wait_ready(self._ctl, keys.ready(self._prefixes[t], n), self._ring, sent, self._timeout_s,
                                       self._superseded, f"tree root rid={self.roots[t]}"))  # fmt: skip
            if (lease := next_lease(self._ring, sent, self._superseded)) is None:
                return
            plans: list[tuple[DeltaStream, Lease] | None] = []
            try:
                for t in range(TREES):  # a tree with no chunk (a version of one chunk) gets its empty half in full
                    plans.append(delta_base(self._ring, self._deltas, self._policy, held[t], lease,
                                            f"tree root rid={self.roots[t]}", self._cuts)
                                 if self._halves[t] else None)  # fmt: skip
            except BaseException:
                for plan in plans:
                    if plan is not None:
                        plan[1].release()
                lease.release()
                raise
            self._send(lease, plans)
            sent, n = lease.ref.version, n + 1
            self._notes = n

    def _send(self, lease: Lease, plans: list[tuple[DeltaStream, Lease] | None]) -> None:
        """Send the leased version to both roots (tree t as ``plans[t]`` says: a delta against a
        leased base, or in full) from a thread left behind (still holding the leases) if the
        topology changes first: see the module; releases the leases.

        Raises:
            Superseded: the topology changed before the version was sent.
        """
        pgs = [pg for pg in self._pgs if pg is not None]

        def release() -> None:
            for plan in plans:
                if plan is not None:
                    plan[1].release()
            lease.release()

        send_apart(lambda: self._send_now(lease, pgs, plans), release, self._superseded,
                   f"wsync-relay-tree-send-v{lease.ref.version}", self._timeout_s)  # fmt: skip

    def _send_now(self, lease: Lease, pgs: list[Interruptible], plans: list[tuple[DeltaStream, Lease] | None]) -> None:
        layout, buffer, (_, seq, version) = self._ring.layout, lease.buffer, lease.ref
        bases = [plan[1] for plan in plans if plan is not None]
        hashed: list[list[int] | None] = []  # the full version's checksums, hashed while the halves go out
        hasher = threading.Thread(target=lambda: hashed.append(self._ring.checksums(lease)),
                                  name=f"wsync-relay-tree-hash-v{version}", daemon=True)  # fmt: skip
        hasher.start()

        def progress() -> None:
            for held in [lease, *bases]:
                held.touch()

        def blame(t: int) -> None:
            self._blame = t

        try:
            for t, pg in enumerate(pgs):
                self._blame = t
                kind = FULL if plans[t] is None else DELTA
                pg.send([hop_header(version, seq, layout, kind, len(self._halves[t]))], 1, 0).wait()
            halves = [half_messages(buffer, self._pieces, self._halves[t], None if plan is None else plan[0])
                      for t, plan in enumerate(plans)]  # fmt: skip
            send_halves(pgs, halves, progress, blame)
        finally:
            hasher.join()
        for plan in plans:
            if plan is not None:
                self._policy.observe(version, plan[0].stats())
        sums = hashed[0] if hashed and all(base.intact() for base in bases) else None
        trailer = signed_trailer(self._ctl, self._epoch, RELAY_RID, version, seq, sums, intact=lease.intact(),
                                 buckets=len(layout.buckets))  # fmt: skip
        for t, pg in enumerate(pgs):
            self._blame = t
            pg.send([trailer], 1, 0).wait()
        log.debug("relay: version %d sent to the tree roots %s", version, self.roots)
