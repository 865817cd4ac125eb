"""What a new sender deletes of the senders before it, so that relaunches leave nothing behind.

Records (:func:`retire_old_epochs`): a sender epoch's are deleted two epochs later
(receivers may still be switching from the one before), the previous senders' version records
at once (a new version follows). Relay keys (:func:`retire_relay_keys`):
a sender SIGKILLed mid-run deletes none of its ``relay/<epoch>/`` keys, nor of its sharded
streams; its successors do, the epochs two or more back at once (as the records), and the
one just before once none of its leaders can still touch them (the relay plane calls it then:
``timeout_s + heartbeat_timeout_s`` of that sender after the successor's start).
"""

from __future__ import annotations

import logging

from lightning_wsync._control import keys
from lightning_wsync._control.records import ShardsRecord
from lightning_wsync._control.store import Control
from lightning_wsync.errors import WeightSyncAuthError, WeightSyncRecordError

log = logging.getLogger(__name__)

_KEEP_EPOCHS = 2  # the current sender epoch and the one before (receivers may still be switching)
_EPOCH_SWEEP = 8  # epochs further back also swept, for senders that died before sweeping


def retire_old_epochs(ctl: Control, epoch: int, latest_version: int | None) -> None:
    """Delete the records and relay keys of sender epochs ``_KEEP_EPOCHS`` or more behind
    ``epoch``, and the version records the previous senders left (up to ``latest_version``; a
    new version follows)."""
    if latest_version is not None:
        retire_versions(ctl, latest_version)
    newest_old = epoch - _KEEP_EPOCHS
    for old in range(max(1, newest_old - _EPOCH_SWEEP), newest_old + 1):
        _retire_shares(ctl, old)
        for key in keys.epoch_keys(old):
            ctl.delete(key)
    if newest_old >= 1:
        retire_relay_keys(ctl, below=newest_old + 1)


def retire_versions(ctl: Control, latest_version: int) -> None:
    """Delete the version records (``v/<n>``, ``v/<n>/sums``) of versions up to ``latest_version``:
    the previous sender's newest few (a sender SIGKILLed deletes none; one that closed left its last),
    by the store's list where it can list its keys, else ``latest_version``'s alone."""
    names = ctl.list_keys("v/")
    if names is None:
        names = list(keys.version_keys(latest_version))
    for name in names:
        number = name.split("/", 2)[1]
        if number.isascii() and number.isdigit() and int(number) <= latest_version:
            ctl.delete(name)


def retire_relay_keys(ctl: Control, below: int) -> int:
    """Delete every ``relay/<n>/`` key of sender epochs below ``below`` (their sharded streams'
    included); how many. Read from the store's list of keys: what a SIGKILLed sender, or the
    leaders that died with it, left is not known by name (hops of the chains it replaced, their
    ``ready`` notes). A store that cannot list its keys keeps them."""
    names = ctl.list_keys("relay/")
    if names is None:
        log.debug("relay keys of sender epochs below %d kept: the store cannot list its keys", below)
        return 0
    gone = 0
    for name in names:
        number = name.split("/", 2)[1]
        if number.isascii() and number.isdigit() and keys.relay_owner(int(number)) < below:
            ctl.delete(name)
            gone += 1
    return gone


def _retire_shares(ctl: Control, epoch: int) -> None:
    """A sharded epoch's notes of each rank (one SIGKILLed mid-run never deleted its own)."""
    try:
        record = ctl.get_record(keys.shards(epoch), ShardsRecord)
    except (WeightSyncRecordError, WeightSyncAuthError):
        return  # not a plan this sender can read: its notes stay (bounded by the ranks of one epoch)
    for rank in range(0 if record is None else record.plan.world):
        ctl.delete(keys.shard_written(epoch, rank))
        ctl.delete(keys.shard_sums(epoch, rank))
