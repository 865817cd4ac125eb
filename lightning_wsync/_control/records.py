"""Every JSON record the package keeps on the store, one type each, with its encoding,
decoding and validation here and nowhere else; the fleet's records (``ReceiverConfig.fleet``)
have a module of their own, :mod:`lightning_wsync._control.fleet_records`.

A record type has ``encode()`` (the JSON value written) and ``decode(value)`` (the
type from a parsed JSON value), which raises :class:`RecordShape` naming what it
expected. Reads go through :meth:`Control.get_record
<lightning_wsync._control.store.Control.get_record>`, which turns any failure into a
:class:`~lightning_wsync.errors.WeightSyncRecordError` naming the key.

Longer than 300 lines: a catalogue of sixteen small types (fourteen stored records, two parts of them);
split further, a record's format would no longer be found next to the others'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import ClassVar, NamedTuple, Protocol, TypeVar

from typing_extensions import Self

from lightning_wsync._control.checks import (
    RecordShape,
    as_bool,
    as_float,
    as_int,
    as_list,
    as_str,
    fields,
)
from lightning_wsync._control.manifest import Manifest
from lightning_wsync._control.shards import ShardPlan

__all__ = [
    "ChainRecord", "ClosedRecord", "DeviceRegion", "LeaderRecord", "ManifestRecord", "MemberRecord", "MemberState",
    "MembersLow", "NixlAgentRecord", "R", "Receipt", "ReceiptsRecord", "Record", "RecordShape", "Rejection",
    "SenderPointer", "SenderRecord", "ShardsRecord", "SumsRecord", "VersionRecord",
]  # fmt: skip


class Record(Protocol):
    """What :meth:`Control.get_record` and :meth:`Control.put` need of a record type."""

    EXPECTED: ClassVar[str]

    def encode(self) -> object: ...

    @classmethod
    def decode(cls, value: object) -> Self: ...


R = TypeVar("R", bound=Record)

# -- the records ----------------------------------------------------------------------
@dataclass(frozen=True)
class SenderPointer:
    """``sender/current``: the epoch receivers should follow."""

    EXPECTED: ClassVar[str] = '{"epoch": <int>}'
    epoch: int

    def encode(self) -> object:
        return {"epoch": self.epoch}

    @classmethod
    def decode(cls, value: object) -> Self:
        return cls(as_int(fields(value, "epoch")["epoch"], "epoch"))


@dataclass(frozen=True)
class SenderRecord:
    """``sender/<epoch>``: where a sender runs and which data planes it offers."""

    EXPECTED: ClassVar[str] = (
        '{"epoch", "host", "pid", "addr", "heartbeat_timeout_s", "timeout_s", "transport", "backend", '
        '"relay", "shm": <str or null>, "sharded": <bool>}'
    )
    epoch: int
    host: str
    pid: int
    addr: str
    heartbeat_timeout_s: float
    timeout_s: float
    transport: str
    backend: str
    relay: bool
    shm: str | None
    sharded: bool = False  # every trainer rank writes its share: read shards/<epoch>
    nixl: bool = False  # hook (NIXL plane): other hosts READ the ring through NIXL (nixl/<epoch>/agent/sender)

    def encode(self) -> object:
        value = asdict(self)
        if not self.nixl:
            del value["nixl"]  # absent when false: readers without the NIXL plane see the same record
        return value

    @classmethod
    def decode(cls, value: object) -> Self:
        v = fields(value, "epoch", "host", "pid", "addr", "heartbeat_timeout_s", "timeout_s", "transport",
                   "backend", "relay", "shm")  # fmt: skip
        shm = v["shm"]
        return cls(
            as_int(v["epoch"], "epoch"), as_str(v["host"], "host"), as_int(v["pid"], "pid"),
            as_str(v["addr"], "addr"), as_float(v["heartbeat_timeout_s"], "heartbeat_timeout_s"),
            as_float(v["timeout_s"], "timeout_s"), as_str(v["transport"], "transport"),
            as_str(v["backend"], "backend"), as_bool(v["relay"], "relay"),
            None if shm is None else as_str(shm, "shm"), as_bool(v.get("sharded", False), "sharded"),
            as_bool(v.get("nixl", False), "nixl"),
        )  # fmt: skip


class DeviceRegion(NamedTuple):
    """A registered region in GPU memory: NIXL's memory kind ``VRAM`` on CUDA device ``device``
    (its index in the owner's process, as the owner registered it)."""

    address: int
    size: int
    device: int


MEMORY_KINDS = ("VRAM",)  # what a record's "mirror" regions may be; host regions are "regions"


@dataclass(frozen=True)
class NixlAgentRecord:
    """``nixl/<epoch>/agent/<who>``: a NIXL agent (hook: the NIXL plane, docs/nixl.md).

    ``regions``: the (address, bytes) ranges the agent registered for remote READs, in
    the owner's order: the ring's header, then each slot (empty for a receiver's agent).
    ``mirror``: the ring's GPU mirror (``cuda_ipc=True``), one region per slot in slot order,
    with its memory kind and device; empty when there is none. It is a key of its own, not
    wider ``regions`` entries, so a reader from before it loads a new owner's record (and
    an old owner's record, without the key, loads here with no mirror).
    """

    EXPECTED: ClassVar[str] = (
        '{"name", "pid", "metadata": <base64>, "regions": [[address, bytes], ...], '
        '"mirror" (optional): [[address, bytes, "VRAM", device], ...]}'
    )
    name: str
    pid: int
    metadata: str  # base64 of nixl_agent.get_agent_metadata()
    regions: tuple[tuple[int, int], ...] = ()
    mirror: tuple[DeviceRegion, ...] = ()

    def encode(self) -> object:
        regions = [list(r) for r in self.regions]
        value: dict[str, object] = {"name": self.name, "pid": self.pid, "metadata": self.metadata, "regions": regions}
        if self.mirror:
            value["mirror"] = [[m.address, m.size, "VRAM", m.device] for m in self.mirror]
        return value

    @classmethod
    def decode(cls, value: object) -> Self:
        v = fields(value, "name", "pid", "metadata", "regions")
        regions: list[tuple[int, int]] = []
        for r in as_list(v["regions"], "regions"):
            pair = as_list(r, "regions[]")
            if len(pair) != 2:
                raise RecordShape(f"regions[] entry {pair!r:.40} is not [address, bytes]")
            regions.append(_region(pair[0], pair[1], "regions"))
        mirror: list[DeviceRegion] = []
        for r in as_list(v.get("mirror", []), "mirror"):
            entry = as_list(r, "mirror[]")
            if len(entry) != 4:
                raise RecordShape(f"mirror[] entry {entry!r:.60} is not [address, bytes, kind, device]")
            kind, device = as_str(entry[2], "mirror[][2]"), as_int(entry[3], "mirror[][3]")
            if kind not in MEMORY_KINDS:
                raise RecordShape(f"mirror[] memory kind {kind!r:.20} is not one of {MEMORY_KINDS}")
            if device < 0:
                raise RecordShape(f"mirror[] device {device} is not a CUDA device index (0 or more)")
            mirror.append(DeviceRegion(*_region(entry[0], entry[1], "mirror"), device))
        return cls(as_str(v["name"], "name"), as_int(v["pid"], "pid"), as_str(v["metadata"], "metadata"),
                   tuple(regions), tuple(mirror))  # fmt: skip


def _region(address: object, size: object, what: str) -> tuple[int, int]:
    a, n = as_int(address, f"{what}[][0]"), as_int(size, f"{what}[][1]")
    if a <= 0 or n <= 0:
        raise RecordShape(f"region [{a}, {n}] is not a positive address and size")
    return a, n


@dataclass(frozen=True)
class ManifestRecord:
    """``manifest/<epoch>``: the published layout (its JSON text, as a string)."""

    EXPECTED: ClassVar[str] = "the JSON text of a manifest"
    layout: Manifest

    def encode(self) -> object:
        return self.layout.to_json()

    @classmethod
    def decode(cls, value: object) -> Self:
        try:
            return cls(Manifest.from_json(as_str(value, "manifest")))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise RecordShape(f"not a manifest ({type(exc).__name__}: {str(exc)[:80]})") from exc


@dataclass(frozen=True)
class ShardsRecord:
    """``shards/<epoch>``: a sharded sender's plan (its JSON text, as a string)."""

    EXPECTED: ClassVar[str] = "the JSON text of a shard plan"
    plan: ShardPlan

    def encode(self) -> object:
        return self.plan.to_json()

    @classmethod
    def decode(cls, value: object) -> Self:
        try:
            plan = ShardPlan.from_json(as_str(value, "shards"))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise RecordShape(f"not a shard plan ({type(exc).__name__}: {str(exc)[:80]})") from exc
        if len(plan.segments) != plan.world or len(plan.hosts) not in (0, plan.world):
            raise RecordShape(f"{len(plan.segments)} segment names and {len(plan.hosts)} hosts for {plan.world} shares")
        return cls(plan)


@dataclass(frozen=True)
class VersionRecord:
    """``latest`` and ``version/<v>``: a published version and the sender epoch that made it."""

    EXPECTED: ClassVar[str] = '{"version": <int>, "epoch": <int>}'
    version: int
    epoch: int

    def encode(self) -> object:
        return {"version": self.version, "epoch": self.epoch}

    @classmethod
    def decode(cls, value: object) -> Self:
        v = fields(value, "version", "epoch")
        return cls(as_int(v["version"], "version"), as_int(v["epoch"], "epoch"))


@dataclass(frozen=True)
class SumsRecord:
    """``version/<v>/sums``: the bucket checksums of a shared-memory version (for ``verify``)."""

    EXPECTED: ClassVar[str] = '{"version": <int>, "sums": [<int>, ...]}'
    version: int
    sums: tuple[int, ...]

    def encode(self) -> object:
        return {"version": self.version, "sums": list(self.sums)}

    @classmethod
    def decode(cls, value: object) -> Self:
        v = fields(value, "version", "sums")
        return cls(as_int(v["version"], "version"), tuple(as_int(s, "sums[]") for s in as_list(v["sums"], "sums")))


@dataclass(frozen=True)
class MemberRecord:
    """``member/<rid>``: a receiver's name and where it runs."""

    EXPECTED: ClassVar[str] = (
        '{"name": <str>, "host": <str>, "pid": <int>, "pidns": <int>, "verify": <bool>, "fleet": <str> or null}'
    )
    name: str
    host: str
    pid: int
    pidns: int = 0
    verify: bool = False
    fleet: str | None = None  # the fleet group it switches versions with (ReceiverConfig.fleet)

    def encode(self) -> object:
        return asdict(self)

    @classmethod
    def decode(cls, value: object) -> Self:
        v = fields(value, "name", "host", "pid")
        fleet = v.get("fleet")
        return cls(as_str(v["name"], "name"), as_str(v["host"], "host"), as_int(v["pid"], "pid"),
                   as_int(v.get("pidns", 0), "pidns"), as_bool(v.get("verify", False), "verify"),
                   None if fleet is None else as_str(fleet, "fleet"))  # fmt: skip


@dataclass(frozen=True)
class Rejection:
    """A version a receiver refused, and why."""

    version: int
    reason: str


@dataclass(frozen=True)
class MemberState:
    """``member/<rid>/state``: the newest version a receiver holds and its last rejection."""

    EXPECTED: ClassVar[str] = '{"acked": <int>, "rejected": null or {"version": <int>, "reason": <str>}}'
    acked: int
    rejected: Rejection | None = None

    def encode(self) -> object:
        rejected = None if self.rejected is None else asdict(self.rejected)
        return {"acked": self.acked, "rejected": rejected}

    @classmethod
    def decode(cls, value: object) -> Self:
        v = fields(value, "acked")
        acked = as_int(v["acked"], "acked")
        if "error" in v and "rejected" not in v:  # receivers before the typed form: [version, reason]
            old = v["error"]
            if old is None:
                return cls(acked)
            pair = as_list(old, "error")
            if len(pair) != 2:
                raise RecordShape(f"error={old!r:.40} is not [version, reason]")
            return cls(acked, Rejection(as_int(pair[0], "error[0]"), as_str(pair[1], "error[1]")))
        rejected = v.get("rejected")
        if rejected is None:
            return cls(acked)
        r = fields(rejected, "version", "reason")
        return cls(acked, Rejection(as_int(r["version"], "rejected.version"), as_str(r["reason"], "rejected.reason")))


@dataclass(frozen=True)
class MembersLow:
    """``members/low``: the lowest receiver id that may still be live."""

    EXPECTED: ClassVar[str] = "<int>"
    low: int

    def encode(self) -> object:
        return self.low

    @classmethod
    def decode(cls, value: object) -> Self:
        return cls(as_int(value, "low"))


@dataclass(frozen=True)
class ClosedRecord:
    """``closed/<epoch>``: the sender ended; ``final`` when training finished."""

    EXPECTED: ClassVar[str] = '{"final": <bool>}'
    final: bool

    def encode(self) -> object:
        return {"final": self.final}

    @classmethod
    def decode(cls, value: object) -> Self:
        if value is True:  # older senders wrote a bare true
            return cls(True)
        return cls(as_bool(fields(value, "final")["final"], "final"))


@dataclass(frozen=True)
class LeaderRecord:
    """``relay/<epoch>/leader/<host>``: which receiver leads a host's relay, and its segment."""

    EXPECTED: ClassVar[str] = (
        '{"rid": <int>, "pid": <int>, "term": <int>, "shm": <str>, "pidns": <int>, "ready": <bool>}'
    )
    rid: int
    pid: int
    term: int
    shm: str  # the host segment this leader serves
    pidns: int = 0  # 0: unknown: its PID is never judged, its heartbeat is
    ready: bool = False  # the segment exists: a host-mate that cannot open it now never will

    def encode(self) -> object:
        return asdict(self)

    @classmethod
    def decode(cls, value: object) -> Self:
        v = fields(value, "rid", "pid", "term", "shm")
        ready = v.get("ready", False)
        if not isinstance(ready, bool):
            raise RecordShape(f"ready={ready!r:.40} is not true or false")
        return cls(as_int(v["rid"], "rid"), as_int(v["pid"], "pid"), as_int(v["term"], "term"),
                   as_str(v["shm"], "shm"), as_int(v.get("pidns", 0), "pidns"), ready)  # fmt: skip


@dataclass(frozen=True)
class ChainRecord:
    """``relay/<epoch>/chain``: the generation and order of the relay leaders, and their shape."""

    EXPECTED: ClassVar[str] = '{"number": <int>, "rids": [<int>, ...], "tree": <bool, default false>}'
    number: int  # the chain number: a new one whenever its leaders change
    rids: tuple[int, ...]
    tree: bool = False  # two complementary binary trees over rids (see _planes.relay.plan), not a chain

    def encode(self) -> object:
        return {"number": self.number, "rids": list(self.rids), "tree": self.tree}

    @classmethod
    def decode(cls, value: object) -> Self:
        v = fields(value, "number", "rids")
        rids = tuple(as_int(r, "rids[]") for r in as_list(v["rids"], "rids"))
        return cls(as_int(v["number"], "number"), rids, as_bool(v.get("tree", False), "tree"))


@dataclass(frozen=True)
class StreamLeadersRecord:
    """``relay/<stream>/leaders``: the live host leaders of one trainer rank's relay stream (rid -> host)."""

    EXPECTED: ClassVar[str] = '{"leaders": {"<rid>": "<host id>", ...}}'
    leaders: dict[int, str]

    def encode(self) -> object:
        return {"leaders": {str(rid): host for rid, host in self.leaders.items()}}

    @classmethod
    def decode(cls, value: object) -> Self:
        raw = fields(value, "leaders")["leaders"]
        if not isinstance(raw, dict):
            raise RecordShape(f"leaders={raw!r:.40} is not an object")
        leaders: dict[int, str] = {}
        for rid, host in raw.items():
            if not str(rid).isdigit():
                raise RecordShape(f"leader rid {rid!r:.20} is not a number")
            leaders[int(rid)] = as_str(host, "leaders[]")
        return cls(leaders)


@dataclass(frozen=True)
class Receipt:
    """How a relay leader got one version: delta or full, bytes on the wire, share changed, decode time."""

    delta: bool
    wire_bytes: int
    changed_share: float
    decode_s: float


@dataclass(frozen=True)
class ReceiptsRecord:
    """``relay/<epoch>/received/<rid>``: a leader's receipts for its recent versions."""

    EXPECTED: ClassVar[str] = '{"<version>": [<bool>, <int>, <number>, <number>], ...}'
    receipts: Mapping[int, Receipt]

    def encode(self) -> object:
        return {str(v): [r.delta, r.wire_bytes, r.changed_share, r.decode_s] for v, r in self.receipts.items()}

    @classmethod
    def decode(cls, value: object) -> Self:
        out: dict[int, Receipt] = {}
        for version, row in fields(value).items():
            if not version.isdigit():
                raise RecordShape(f"version {version!r:.40} is not an integer")
            cells = as_list(row, version)
            if len(cells) != 4:
                raise RecordShape(f"{version}={row!r:.40} is not [delta, wire_bytes, changed_share, decode_s]")
            delta, wire_bytes = as_bool(cells[0], "delta"), as_int(cells[1], "wire_bytes")
            share, decode_s = as_float(cells[2], "changed_share"), as_float(cells[3], "decode_s")
            out[int(version)] = Receipt(delta, wire_bytes, share, decode_s)
        return cls(out)
