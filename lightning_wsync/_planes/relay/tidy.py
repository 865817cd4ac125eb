"""What the relay deletes so that the store stays bounded however often its chain changes,
and :func:`peek`, the read that tolerates a key deleted under it.

Each side of a hop deletes its keys when it leaves the hop (:func:`forget_hop`). What a
side cannot delete because it was SIGKILLed, the sender's :class:`RelaySweeper` does once
nobody can still be using it: the hops of chains replaced ``linger_s`` ago, and the
``received``, ``broken`` and ``leader`` keys of leaders that left the chain.

A replaced chain's hops are deleted by the store's list of keys, not by name: a leader's ``ready``
note for its next send can reach the store after its upstream left the hop (and deleted that
note's key, empty then), and a leader SIGKILLed before it sees the new chain leaves it there. Its
number is the hop's count of sends, which the sender does not know: a deletion by name covers
``ready/0`` only, and such a note stays for good (issue 32: a chaos run's ``relay/1/pg/5/4/ready/2``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from lightning_wsync._control import keys
from lightning_wsync._control.records import LeaderRecord
from lightning_wsync._control.store import Control
from lightning_wsync.errors import WeightSyncError


def peek(ctl: Control, key: str) -> str | None:
    """The value at ``key``, or None, in one request that never waits (``Control.get_text``)."""
    return ctl.get_text(key)


def forget_hop(ctl: Control, prefix: str, rank: int, *, spent: bool, notes: Iterable[int] = ()) -> None:
    """Delete side ``rank``'s mark on the hop under ``prefix``, which it has left.

    ``spent``: its group was built, so it can never be joined again: the peer's mark,
    gloo's keys and the ``ready`` notes ``notes`` go too. A hop that was never built keeps
    the peer's mark (the peer may be waiting on this side, which may come back to it).
    """
    names = [keys.joined(prefix, rank)]
    if spent:
        names += [keys.joined(prefix, 1 - rank), *keys.group_keys(prefix), *(keys.ready(prefix, n) for n in notes)]
    for name in names:
        ctl.delete(name)


@dataclass(frozen=True)
class _Departed:
    rid: int
    host: str
    at: float


class RelaySweeper:
    """The sender's side: deletes the relay keys of chains and leaders that are gone.

    ``linger_s`` (the hop timeout plus the heartbeat timeout) is how long a replaced chain's
    hops, or a departed leader, may still be touched by a process that has not noticed.
    """

    def __init__(self, epoch: int, linger_s: float) -> None:
        self._epoch = epoch
        self._linger_s = linger_s
        self._replaced: list[tuple[int, tuple[int, ...], bool, float]] = []  # (gen, rids, tree, when replaced)
        self._leaders: dict[int, str] = {}  # rid -> host, as last seen
        self._departed: list[_Departed] = []

    def replaced(self, gen: int, rids: tuple[int, ...], tree: bool = False) -> None:
        """Chain ``gen`` (two trees if ``tree``) was just replaced by a newer one."""
        self._replaced.append((gen, rids, tree, time.monotonic()))

    def sweep(self, ctl: Control, leaders: dict[int, str]) -> None:
        """Called with the live leaders (rid -> host) at every chain update."""
        now = time.monotonic()
        for rid, host in self._leaders.items():
            if rid not in leaders:
                self._departed.append(_Departed(rid, host, now))
                self._forget_leader(ctl, rid)
        self._leaders = dict(leaders)
        due = now - self._linger_s
        ripe = sum(1 for *_, when in self._replaced if when <= due)  # replaced in order: the first ``ripe``
        if ripe:
            self._forget_chains(ctl, [(gen, rids, tree) for gen, rids, tree, _ in self._replaced[:ripe]])
            del self._replaced[:ripe]
        hosts = set(leaders.values())
        while self._departed and self._departed[0].at <= due:
            gone = self._departed.pop(0)
            if gone.rid not in leaders:
                self._forget_leader(ctl, gone.rid, host=None if gone.host in hosts else gone.host)

    def close(self, ctl: Control, gen: int, rids: tuple[int, ...], tree: bool = False) -> None:
        """The sender leaves: everything it remembers, the current chain ``gen`` included."""
        chains = [(old_gen, old_rids, old_tree) for old_gen, old_rids, old_tree, _ in self._replaced]
        if gen:  # chain 0: there never was one
            chains.append((gen, rids, tree))
        if chains:
            self._forget_chains(ctl, chains)
        self._replaced = []
        for rid in self._leaders:
            self._forget_leader(ctl, rid)
        for gone in self._departed:
            self._forget_leader(ctl, gone.rid)
        ctl.delete(keys.relay_chain(self._epoch))

    def _forget_chains(self, ctl: Control, chains: list[tuple[int, tuple[int, ...], bool]]) -> None:
        """Delete every key of the hops of ``chains`` (gen, rids, tree) and of every chain numbered
        below them: by the store's list of keys, in one request, so that a ``ready`` note of any
        number goes, and so does what a side stopped past an earlier sweep wrote back since. A
        store that cannot list its keys (not a ``TCPStore``) has them deleted by name: the marks,
        gloo's keys and the first ``ready`` note of each hop."""
        prefix = keys.relay_hops(self._epoch)
        names = ctl.list_keys(prefix)
        if names is None:
            for gen, rids, tree in chains:
                for rid in rids:
                    for t in (0, 1) if tree else (None,):
                        forget_hop(ctl, keys.relay_hop_prefix(self._epoch, gen, rid, t), 0, spent=True, notes=(0,))
            return
        newest = max(gen for gen, _, _ in chains)
        for name in names:
            number = name[len(prefix) :].split("/", 1)[0]
            if number.isascii() and number.isdigit() and int(number) <= newest:
                ctl.delete(name)

    def _forget_leader(self, ctl: Control, rid: int, host: str | None = None) -> None:
        ctl.delete(keys.relay_received(self._epoch, rid))
        ctl.delete(keys.relay_broken(self._epoch, rid))
        ctl.delete(keys.relay_bell(self._epoch, rid))
        if host is not None:  # its host has had no live leader since: a record naming it is stale
            key = keys.relay_leader(self._epoch, host)
            raw = peek(ctl, key)
            try:
                named = None if raw is None else ctl.decode(key, raw, LeaderRecord).rid
            except WeightSyncError:  # unreadable or forged: nobody can follow it either
                named = rid
            if named == rid:
                ctl.delete(key)
