"""The records of one version across a fleet (``ReceiverConfig.fleet``): the sender's side
writes them in :mod:`lightning_wsync._push.fleet`, the members' side in
:mod:`lightning_wsync._pull.fleet`.

As in :mod:`lightning_wsync._control.records`: ``encode()`` gives the JSON value
written, ``decode(value)`` the type from a parsed JSON value (raising
:class:`~lightning_wsync._control.checks.RecordShape` naming what it expected); reads go
through :meth:`Control.get_record <lightning_wsync._control.store.Control.get_record>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import ClassVar

from typing_extensions import Self

from lightning_wsync._control.checks import as_bool, as_float, as_int, as_list, as_str, fields

__all__ = ["NOT_FOLLOWING", "FleetAck", "FleetRound", "FleetSwitch", "FleetSwitches"]

NOT_FOLLOWING = -2  # FleetAck.round of a member that does not follow the sender yet


@dataclass(frozen=True)
class FleetAck:
    """``member/<rid>/fleet``: a fleet member's group, the newest round it saw, the version it
    has staged (-1: none) and whether it holds a switched version not yet applied."""

    EXPECTED: ClassVar[str] = '{"group": <str>, "round": <int>, "staged": <int>, "holding": <bool>}'
    group: str
    round: int = -1
    staged: int = -1
    holding: bool = False

    def encode(self) -> object:
        return asdict(self)

    @classmethod
    def decode(cls, value: object) -> Self:
        v = fields(value, "group", "round", "staged", "holding")
        return cls(as_str(v["group"], "group"), as_int(v["round"], "round"), as_int(v["staged"], "staged"),
                   as_bool(v["holding"], "holding"))  # fmt: skip


@dataclass(frozen=True)
class FleetRound:
    """``fleet/<group>/round``: the group's newest round: the target version every member of
    ``rids`` stages (the sender keeps it in its ring until the round ends), with its bucket
    checksums when a member verifies (the version's own ``v/<version>/sums`` may be gone by then)."""

    EXPECTED: ClassVar[str] = '{"round": <int>, "version": <int>, "rids": [<int>, ...], "sums": [<int>, ...]}'
    round: int
    version: int
    rids: tuple[int, ...]
    sums: tuple[int, ...] = ()  # its bucket checksums, when a member verifies

    def encode(self) -> object:
        return {"round": self.round, "version": self.version, "rids": list(self.rids), "sums": list(self.sums)}

    @classmethod
    def decode(cls, value: object) -> Self:
        v = fields(value, "round", "version", "rids")
        rids = tuple(as_int(r, "rids[]") for r in as_list(v["rids"], "rids"))
        sums = tuple(as_int(x, "sums[]") for x in as_list(v.get("sums", []), "sums"))
        return cls(as_int(v["round"], "round"), as_int(v["version"], "version"), rids, sums)


@dataclass(frozen=True)
class FleetSwitch:
    """One switch of a fleet group: every member of ``rids`` staged ``version`` and may apply it.

    ``excluded``: member name -> why it is left out of this version; ``at``: the sender's
    wall-clock time (``time.time()``) of the switch.
    """

    round: int
    version: int
    rids: tuple[int, ...]
    excluded: Mapping[str, str]
    at: float


@dataclass(frozen=True)
class FleetSwitches:
    """``fleet/<group>/switch``: the group's newest few switches, oldest first."""

    EXPECTED: ClassVar[str] = (
        '{"switches": [{"round": <int>, "version": <int>, "rids": [<int>, ...], '
        '"excluded": {"<name>": <str>, ...}, "at": <number>}, ...]}'
    )
    switches: tuple[FleetSwitch, ...]

    def encode(self) -> object:
        return {"switches": [
            {"round": s.round, "version": s.version, "rids": list(s.rids), "excluded": dict(s.excluded), "at": s.at}
            for s in self.switches
        ]}  # fmt: skip

    @classmethod
    def decode(cls, value: object) -> Self:
        out = []
        for item in as_list(fields(value, "switches")["switches"], "switches"):
            v = fields(item, "round", "version", "rids", "excluded", "at")
            excluded = {as_str(k, "excluded name"): as_str(r, "excluded reason")
                        for k, r in fields(v["excluded"]).items()}  # fmt: skip
            rids = tuple(as_int(r, "rids[]") for r in as_list(v["rids"], "rids"))
            out.append(FleetSwitch(as_int(v["round"], "round"), as_int(v["version"], "version"), rids, excluded,
                                   as_float(v["at"], "at")))  # fmt: skip
        return cls(tuple(out))
