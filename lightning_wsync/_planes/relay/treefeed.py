"""The sender's side of a tree topology: half of every version to each tree's root.

See :mod:`~lightning_wsync._planes.relay.plan` for the shape. Each root's hop is a
two-rank group of its own under ``relay/<epoch>/pg/<number>/t<tree>/<rid>/``; both get
the same header (the version, its snapshot sequence, how many chunks follow), their
half of the chunks, and the same signed trailer. A root whose hop fails is marked broken
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
from collections.abc import Callable

from lightning_wsync._control import keys
from lightning_wsync._control.store import Control
from lightning_wsync._planes.relay.hops import (
    RELAY_RID,
    Chain,
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
from lightning_wsync._planes.shm.ring import Lease, SnapshotRing
from lightning_wsync._planes.wire import FULL, Interruptible, Work, close_group, signed_trailer

log = logging.getLogger(__name__)


class TreeFeed:
    """One tree topology (one chain number) as the sender feeds it."""

    def __init__(
        self, ctl: Control, ring: SnapshotRing, chain: Chain, *, epoch: int, backend: str, addr: str,
        timeout_s: float, superseded: Callable[[], bool],
    ) -> None:  # fmt: skip
        self._ctl = ctl
        self._ring = ring
        self._epoch = epoch
        self._backend = backend
        self._addr = addr
        self._timeout_s = timeout_s
        self._superseded = superseded
        self._pieces = chunks(ring.layout)
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
        while not self._superseded():
            for t in range(TREES):
                self._blame = t
                wait_ready(self._ctl, keys.ready(self._prefixes[t], n), self._ring, sent, self._timeout_s,
                           self._superseded, f"tree root rid={self.roots[t]}")  # fmt: skip
            if (lease := next_lease(self._ring, sent, self._superseded)) is None:
                return
            self._send(lease)
            sent, n = lease.ref.version, n + 1
            self._notes = n

    def _send(self, lease: Lease) -> None:
        """Send the leased version to both roots from a thread left behind (still holding the
        lease) if the topology changes first: see the module; releases ``lease``.

        Raises:
            Superseded: the topology changed before the version was sent.
        """
        pgs = [pg for pg in self._pgs if pg is not None]
        send_apart(lambda: self._send_now(lease, pgs), lease.release, self._superseded,
                   f"wsync-relay-tree-send-v{lease.ref.version}")  # fmt: skip

    def _send_now(self, lease: Lease, pgs: list[Interruptible]) -> None:
        layout, buffer, (_, seq, version) = self._ring.layout, lease.buffer, lease.ref
        works: list[list[Work]] = []
        for t, pg in enumerate(pgs):
            self._blame = t
            pg.send([hop_header(version, seq, layout, FULL, len(self._halves[t]))], 1, 0).wait()
            works.append([pg.send([buffer[a:b]], 1, 0) for a, b, _ in (self._pieces[i] for i in self._halves[t])])
        sums = self._ring.checksums(lease)  # while gloo streams the chunks
        for k in range(max(len(w) for w in works)):  # in the order they go out, alternating trees
            for t in range(TREES):
                if k < len(works[t]):
                    self._blame = t
                    works[t][k].wait()
            lease.touch()
        trailer = signed_trailer(self._ctl, self._epoch, RELAY_RID, version, seq, sums, intact=lease.intact(),
                                 buckets=len(layout.buckets))  # fmt: skip
        for t, pg in enumerate(pgs):
            self._blame = t
            pg.send([trailer], 1, 0).wait()
        log.debug("relay: version %d sent to the tree roots %s", version, self.roots)
