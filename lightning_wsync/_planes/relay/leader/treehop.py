"""A host leader's part in a tree topology: two halves in, one tree's half on to its children.

See :mod:`~lightning_wsync._planes.relay.plan` for the shape. The leader joins one hop
from its parent in each tree (under ``relay/<epoch>/pg/<number>/t<tree>/<rid>/``; the
parent may be the sender) and one :class:`~lightning_wsync._planes.relay.down.Downstream`
per child. Per version both halves are received at once, each in its own thread that
forwards every chunk to that tree's children as soon as it lands, so neither tree waits
for the other; this thread hashes the buckets in order as their chunks come in. The
version is accepted only when both halves carry the same version, snapshot sequence and
trailer, and the trailer's MAC and every checksum verify, exactly as on a chain.

Each half comes in full or as a delta (:mod:`~lightning_wsync._planes.relay.treedelta`),
decided edge by edge from what the downstream side holds, as on a chain.

A topology change mid-version ends both halves at once: a parent in the old topology may
never finish this version (it left, or waits on one that did), and a wait on it would end
only at timeout_s, keeping this leader and its subtrees out of the new topology as long;
the sender resends the newest version there. Interrupting closes both pairs, but gloo does
not wake every wait on a closed pair (seen: a receive whose data was landing waited out the
group timeout), so the halves' threads are not waited for: what is left of them ends on its
own, touching nothing but that call's locals and the closed groups (a process that ends
normally meanwhile waits for them at exit: :mod:`~lightning_wsync._planes.relay.exits`).

Longer than 300 lines: a leader's two halves (:class:`TreeHop`, which share the landed events
and the topology watch; split, each part would reach into the other) and the hops it serves
them on (:class:`TreeLead`). The draft, the base, the check and the resend are the chain's as
well: :class:`~lightning_wsync._planes.relay.leader.hop.HopReceiver`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import xxhash

from lightning_wsync._control import keys
from lightning_wsync._control.store import Control
from lightning_wsync._planes.delta.codec import word_bytes_for
from lightning_wsync._planes.delta.wire import DeltaStats, Held
from lightning_wsync._planes.relay import exits
from lightning_wsync._planes.relay.down import Downstream
from lightning_wsync._planes.relay.hops import CHAIN_POLL_S, POLL_S, Chain, Stream, Superseded, error_text, join_hop
from lightning_wsync._planes.relay.leader.hop import Expected, HopReceiver, Message
from lightning_wsync._planes.relay.plan import TREES, half, tree_links
from lightning_wsync._planes.relay.tidy import forget_hop
from lightning_wsync._planes.relay.treedelta import DeltaHalf, HalfStats, chunk_layout
from lightning_wsync._planes.wire import (
    DELTA,
    OVERWRITTEN,
    Header,
    Interruptible,
    PeerGroup,
    Work,
    close_group,
    to_int64,
)

log = logging.getLogger(__name__)

_WINDOW = 8  # chunk receives posted ahead in each tree


class TreeHop:
    """A tree's shape upstream: a leader's two halves, read through its one :class:`HopReceiver`."""

    def __init__(self, receiver: HopReceiver, timeout_s: float = 10.0) -> None:
        """``timeout_s``: the hops' group timeout (the sender's), which bounds each of a half's waits."""
        self.receiver = receiver
        self.timeout_s = timeout_s
        layout = receiver.layout
        self.halves = [half(len(receiver.pieces), t) for t in range(TREES)]
        self._cuts = chunk_layout(layout)  # what a tree's delta records are cut by
        self._words = max(1, layout.total_bytes // word_bytes_for(layout))

    def receive_both(
        self, pgs: list[Interruptible], downs: list[list[Downstream]], still_current: Callable[[], bool]
    ) -> Message:
        """Receive both halves of the next version, forwarding each as it comes.

        Raises:
            Superseded: the topology changed before one tree's header came (its parent has
                moved on and will never send it).
        """
        hop = self.receiver
        expected = hop.expected  # this version's headers: a half-thread left behind reads no later ones
        assert expected is not None, "expect() first"
        held, generation = hop.begin()  # held: the base of a delta half
        landed = [threading.Event() for _ in hop.pieces]
        heads: list[Header | None] = [None] * TREES
        trailers: list[list[int]] = [[] for _ in range(TREES)]
        stats = [HalfStats() for _ in range(TREES)]
        errors: list[BaseException] = []

        def stream(t: int) -> None:
            try:
                heads[t], trailers[t], stats[t] = self._receive_half(t, pgs[t], downs[t], landed, still_current, held,
                                                                     generation, expected)  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - re-raised by the receiving thread
                errors.append(exc)
                for event in landed:
                    event.set()

        # Waited for at the process's exit while they run: one left behind may be inside a
        # receive until the group timeout (exits.py).
        threads = [exits.start(functools.partial(stream, t), f"wsync-relay-tree{t}", self.timeout_s)
                   for t in range(TREES)]  # fmt: skip
        interrupted = False

        def watch() -> bool:
            """Once the topology has changed, end both halves (True from then on): see the module."""
            nonlocal interrupted
            if not interrupted and not still_current():
                interrupted = True
                for pg in pgs:
                    pg.interrupt()
            return interrupted

        sums = self._hash_in_order(landed, errors, watch)
        for thread in threads:
            while thread.is_alive() and not interrupted:
                thread.join(CHAIN_POLL_S)
                watch()
        if interrupted and not errors:
            raise Superseded("the topology changed mid-version")
        if errors:
            raise errors[0]
        return self._message(heads, trailers, stats, sums)

    def _message(
        self, heads: list[Header | None], trailers: list[list[int]], stats: list[HalfStats], sums: list[int]
    ) -> Message:
        """Both halves as one version: they must carry the same version, sequence and trailer."""
        h0, h1 = heads
        assert h0 is not None and h1 is not None
        # A parent that could not rebuild its delta half marks the trailer it forwards (first word).
        if (h0.version, h0.seq) != (h1.version, h1.seq) or trailers[0][1:] != trailers[1][1:]:
            raise RuntimeError(f"the trees are out of step: version {h0.version} (seq {h0.seq}) in tree 0, "
                               f"{h1.version} (seq {h1.seq}) in tree 1, or their trailers differ")  # fmt: skip
        trailer = min(trailers, key=lambda words: words[0] != OVERWRITTEN)
        error = next((s.error for s in stats if s.error is not None), None)
        changed = sum(s.changed_words for s in stats)
        delta = any(s.delta for s in stats)
        total = DeltaStats(
            changed_share=changed / self._words if delta else 1.0,
            full_bytes=self.receiver.layout.total_bytes,
            wire_bytes=sum(s.wire_bytes for s in stats),
            decode_s=sum(s.decode_s for s in stats),
        )
        return Message(h0.version, h0.seq, delta, trailer, None if error else sums, error, total)  # fmt: skip

    def _receive_half(
        self, t: int, pg: Interruptible, downs: list[Downstream], landed: list[threading.Event],
        still_current: Callable[[], bool], held: Held | None, generation: int, expected: Expected,
    ) -> tuple[Header, list[int], HalfStats]:  # fmt: skip
        """Tree ``t``'s half of the version: its header, then its pieces in full or as a delta
        (each forwarded to ``downs`` as it lands); the trailer, and how the half came."""
        hop = self.receiver
        head = self._await_header(expected, t, still_current)
        mine = self.halves[t]
        head.check(hop.layout.total_bytes, len(mine), len(mine))
        if head.kind == DELTA:
            delta = DeltaHalf(self._cuts, mine, held=held, base=hop.base, target=hop.target,
                              fence=lambda: hop.fenced(generation))  # fmt: skip
            modes = delta.receive(pg, head.version, head.seq, downs, landed)
            stats = delta.stats
        else:
            with hop.fenced(generation):
                window = deque(hop.post(pg, i) for i in mine[:_WINDOW])
            modes = [d.begin(head.version, head.seq, None, None) for d in downs]
            self._stream(pg, t, window, list(zip(downs, modes)), landed, generation)
            stats = HalfStats(wire_bytes=sum(hop.pieces[i][1] - hop.pieces[i][0] for i in mine))
        return head, hop.trailer(pg, list(zip(downs, modes)), rebuilt=stats.error is None), stats

    def _await_header(self, expected: Expected, t: int, still_current: Callable[[], bool]) -> Header:
        """Tree ``t``'s header, waited for in this half's thread (a leader waiting for both
        before forwarding either would wait on a leader that waits on it: the trees cross)."""
        next_check = time.monotonic() + CHAIN_POLL_S
        while not expected.landed(t):
            now = time.monotonic()
            if now >= next_check:
                next_check = now + CHAIN_POLL_S
                if not still_current():
                    raise Superseded(f"tree {t}")
            time.sleep(POLL_S)
        return expected.header(t)

    def _stream(
        self, pg: PeerGroup, t: int, window: deque[Work], downs: list[tuple[Downstream, int | None]],
        landed: list[threading.Event], generation: int,
    ) -> None:  # fmt: skip
        """One tree's half in full: each chunk forwarded to this tree's children as it lands."""
        hop, mine = self.receiver, self.halves[t]
        for k, i in enumerate(mine):
            window.popleft().wait()
            with hop.fenced(generation):
                if k + len(window) + 1 < len(mine):
                    window.append(hop.post(pg, mine[k + len(window) + 1]))
            a, b, _ = hop.pieces[i]
            for down, mode in downs:
                if mode is not None:
                    down.send(hop.target[a:b])
            landed[i].set()

    def _hash_in_order(
        self, landed: list[threading.Event], errors: list[BaseException], watch: Callable[[], bool]
    ) -> list[int]:
        hop = self.receiver
        sums: list[int] = []
        hasher = xxhash.xxh3_64()
        last = {bucket: i for i, (_, _, bucket) in enumerate(hop.pieces)}
        for i, (a, b, bucket) in enumerate(hop.pieces):
            while not landed[i].wait(CHAIN_POLL_S):
                if watch():
                    return sums
            if errors:
                return sums
            hasher.update(hop.target[a:b].numpy().data)
            if last[bucket] == i:
                sums.append(to_int64(hasher.intdigest()))
                hasher = xxhash.xxh3_64()
        return sums

    def resend_half(self, down: Downstream, t: int) -> bool:
        """Send tree ``t``'s half of the version this leader holds to a child that connected
        after it went by; False when there is none to send."""
        version = self.receiver.resend(down, self.halves[t])
        if version is None:
            return False
        log.info("relay: tree %d's half of version %d resent to a child that connected after it went by", t, version)
        return True


class TreeLead:
    """One leader's hops in one tree topology (one chain number): joined, served, left."""

    def __init__(
        self, ctl: Control, receiver: HopReceiver, chain: Chain, stream: Stream, *, rid: int,
        stop: threading.Event, current: Callable[[int], bool],
    ) -> None:  # fmt: skip
        """``receiver``: the leader's one receive path, read here in the tree's shape;
        ``current``: the leader's bell (whether a chain number is still served, without a store
        request); the hops downstream wait for their children's notes and ask it when nudged."""
        links = tree_links(chain.rids, rid)
        self._ctl = ctl
        self._receiver = receiver
        self._hop = hop = TreeHop(receiver, stream.timeout_s)
        self._chain = chain
        epoch, self._backend, self._addr, self._timeout_s = stream.number, stream.backend, stream.addr, stream.timeout_s
        self._stop = stop
        self._prefixes = [keys.relay_hop_prefix(epoch, chain.number, rid, t) for t in range(TREES)]
        self.downs = [
            [Downstream(ctl, stream, chain, child, receiver.layout, tree=t, current=current, pieces=len(hop.halves[t]))
             for child in links.children[t]]
            for t in range(TREES)
        ]  # fmt: skip
        self.pgs: list[Interruptible] = []
        self._notes = 0

    def serve(self, superseded: Callable[[], bool], accept: Callable[[Message], None]) -> bool:
        """Serve this topology until it changes (or this leader stops leading); True when
        it failed after its hops were built (they cannot be joined again: wait for the next one)."""
        try:
            self._run(lambda: not superseded(), accept)
            return False
        except Superseded:
            return False
        except Exception as exc:  # noqa: BLE001 - rebuilt with the next topology
            if not self._stop.is_set():
                log.info("relay: hops from the trees ended (%s)", error_text(exc)[:200])
                self._stop.wait(CHAIN_POLL_S)
            return bool(self.pgs)
        finally:
            self.close()

    def _run(self, still_current: Callable[[], bool], accept: Callable[[Message], None]) -> None:
        """Join the hops from both parents, then receive and forward until the topology changes."""
        for prefix in self._prefixes:
            pg = join_hop(self._ctl, prefix, 1, self._backend, self._addr, self._timeout_s, lambda: not still_current())
            self.pgs.append(Interruptible(pg, self._backend))
            log.debug("relay: joined the hop %s", prefix)
        hop, receiver, n, next_check = self._hop, self._receiver, 0, 0.0
        every = [(t, d) for t in range(TREES) for d in self.downs[t]]
        while not self._stop.is_set():
            for prefix in self._prefixes:
                self._ctl.set_text(keys.ready(prefix, n), receiver.ready_note())
            receiver.expect(self.pgs)  # each tree's header is waited for in its own half's thread
            while not receiver.arrived():
                for t, down in every:
                    if down.missed and down.connected() and hop.resend_half(down, t):
                        down.finish()
                if self._stop.wait(POLL_S):
                    return
                now = time.monotonic()
                if now >= next_check:  # a new topology or a lost election ends these hops
                    next_check = now + CHAIN_POLL_S
                    if not still_current():
                        return
            msg = hop.receive_both(self.pgs, self.downs, still_current)
            n = self._notes = n + 1
            accept(msg)
            for _, down in every:
                down.finish()

    def nudge(self) -> None:
        """The bell rang: every hop downstream that the chain left behind stops now."""
        for downs in self.downs:
            for down in downs:
                down.nudge()

    def close(self) -> None:
        for downs in self.downs:
            for down in downs:
                down.close()
        for pg in self.pgs:
            # The parents' sends into this side end now, but one already part-written: at their timeout_s.
            close_group(pg, 0, self._backend)
        for t, prefix in enumerate(self._prefixes):
            forget_hop(self._ctl, prefix, 1, spent=t < len(self.pgs), notes=(self._notes,))
        # Dropped, not only aborted: an aborted group keeps its sockets open until it is
        # freed, and a parent still sending into them would block until its group timeout.
        self.pgs.clear()
        self._receiver.forget_headers()
