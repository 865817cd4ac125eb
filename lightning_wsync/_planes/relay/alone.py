"""A receiver that cannot map its host's ring of a sharded sender's stream receives that stream as a
host of its own: over the network, into a ring it makes itself.

Each stream of a sharded push (:mod:`~lightning_wsync._planes.relay.head.streams`) reaches a host
once, into a host ring that its leader makes and every receiver of the host maps. A receiver that
cannot map it (another /dev/shm or mount namespace on the same host id, a ring it may not open), or
that cannot map a trainer rank's own ring on its host, stands *alone* in that stream: it runs for
election under a host id of its own (:func:`alone_host`), which nobody else claims, so it leads it and
gets the stream over the network like any other host, one more copy into its machine. It adds itself
to ``relay/<stream>/alone`` (rid -> that host id; compare-and-set, as a few receivers may write at
once), and the stream's head, rank 0, adds the live ones to the stream's leaders (:func:`alone_leaders`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from lightning_wsync._control import keys
from lightning_wsync._control.records import LeaderRecord, StreamLeadersRecord
from lightning_wsync._control.store import Control
from lightning_wsync._planes.base import Peer
from lightning_wsync.errors import WeightSyncAuthError, WeightSyncError, WeightSyncRecordError

log = logging.getLogger(__name__)

_TRIES = 20  # compare-and-set rounds lost to other writers of the record before giving up (each: one got in)


def alone_host(host: str, rid: int) -> str:
    """The host id that receiver ``rid`` of host ``host`` leads by itself in a stream it stands alone in."""
    return f"{host}/alone-r{rid}"


def _edit(ctl: Control, stream: int, rid: int, host: str | None) -> bool:
    key = keys.relay_stream_alone(stream)
    for _ in range(_TRIES):
        raw = ctl.get_text(key)
        try:
            record = None if raw is None else ctl.decode(key, raw, StreamLeadersRecord)
        except (WeightSyncRecordError, WeightSyncAuthError) as exc:  # replaced by a good one
            log.debug("relay: %s", exc)
            record = None
        alone = {} if record is None else dict(record.leaders)
        if host is None:
            if alone.pop(rid, None) is None:
                return True
        else:
            alone[rid] = host
        sealed = ctl.seal(key, StreamLeadersRecord(alone).encode())
        if ctl.compare_set(key, raw or "", sealed).decode("utf-8", "replace") == sealed:
            ctl.bump(keys.relay_moved(stream))  # the head reads its leaders again
            return True
    return False


def stand_alone(ctl: Control, stream: int, rid: int, host: str) -> bool:
    """Name receiver ``rid`` a host of its own (``host``, from :func:`alone_host`) in ``stream``; False
    when other writers kept the record moving for every try."""
    return _edit(ctl, stream, rid, host)


def leave_alone(ctl: Control, stream: int, rid: int) -> None:
    """Take receiver ``rid`` off ``stream``'s alone record (it leaves); the store's loss is not an error."""
    try:
        _edit(ctl, stream, rid, None)
    except WeightSyncError as exc:
        log.debug("relay: stream %d's alone record left as it is: %s", stream, exc)


def alone_leaders(ctl: Control, stream: int, live: Sequence[Peer]) -> dict[int, str]:
    """rid -> host id of the live receivers that stand alone in ``stream`` and lead their own host."""
    try:
        record = ctl.get_record(keys.relay_stream_alone(stream), StreamLeadersRecord)
    except (WeightSyncRecordError, WeightSyncAuthError) as exc:
        log.debug("relay: %s", exc)
        return {}
    if record is None:
        return {}
    rids = {p.rid for p in live}
    out: dict[int, str] = {}
    for rid, host in sorted(record.leaders.items()):
        if rid not in rids:
            continue
        try:
            leader = ctl.get_record(keys.relay_leader(stream, host), LeaderRecord)
        except (WeightSyncRecordError, WeightSyncAuthError) as exc:
            log.debug("relay: %s", exc)
            continue
        if leader is not None and leader.rid == rid:
            out[rid] = host
    return out
