"""A host-mate hears news off its leader's board, not the store.

There, bumps of ``news`` are versions only when the leader read the same sender, not closed,
at or after them (or, from an older board, when one bump came with a new ``latest``): the
``latest`` record is then taken from the board (sealed: verified here). Anything else (a new
sender, a close) has the watcher read the records from the store.
"""

from __future__ import annotations

from lightning_wsync._control import keys
from lightning_wsync._control.records import SenderPointer, VersionRecord
from lightning_wsync._control.store import Control
from lightning_wsync._planes.base import BoardRead, HostNews
from lightning_wsync.errors import WeightSyncAuthError, WeightSyncRecordError


def read_news(ctl: Control, board: HostNews, news: str | None, latest_raw: str | None, epoch: int) -> BoardRead:
    """The news off ``board`` for a host-mate following sender ``epoch``, against ``news`` as it
    last read it through and ``latest_raw``, the ``latest`` record it holds."""
    seen, raw = board.news, board.latest
    if seen is None or raw is None or news is None or seen == news:
        return BoardRead(seen, False)
    if not _same_sender(ctl, board, epoch) and (raw == latest_raw or not _one_bump(news, seen)):
        return BoardRead(seen, False)
    if raw == latest_raw:
        return BoardRead(seen, True)
    try:
        return BoardRead(seen, True, ctl.decode(keys.LATEST, raw, VersionRecord))
    except (WeightSyncAuthError, WeightSyncRecordError):
        return BoardRead(seen, False)  # read from the store instead, which reports it


def _same_sender(ctl: Control, board: HostNews, epoch: int) -> bool:
    """The leader's board says the sender followed here is still current and has not closed."""
    if board.closed or board.sender is None:
        return False
    try:
        return ctl.decode(keys.SENDER_CURRENT, board.sender, SenderPointer).epoch == epoch
    except (WeightSyncAuthError, WeightSyncRecordError):
        return False  # the store's reading reports it


def _one_bump(before: str, after: str) -> bool:
    """``after`` is the ``news`` counter one bump past ``before`` (a garbled counter is not)."""
    try:
        return int(after) == int(before) + 1
    except ValueError:
        return False
