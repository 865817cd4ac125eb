"""A relay host's board: what its leader tells the host-mates through the host, not the store.

The leader keeps a small file, ``board``, in its host segment's pin directory
(``/dev/shm/<segment>.pins/``, removed with the segment): the ``news`` counter as its own
watcher last read it from the store, and the ``latest`` record as read with it. It
rewrites the file when either moves and touches it every ``beat_s``, so the file's age
is the leader's heartbeat on the host. A host-mate that reads the leader's ring reads the
board instead of asking the store: it learns of new versions from it (the ring's wake-up
brings the bytes), and judges its leader by the board's age (and by its PID, from the same
PID namespace) instead of polling the leader's record and heartbeat on the store.

The board also says which note of each host-mate the leader last passed on to the store
(``mates``: rid -> the note's sequence number, :mod:`~lightning_wsync._planes.relay.mate.notes`):
a host-mate whose notes stop being passed on beats and acknowledges on the store itself.

Whoever reads the ring shares the leader's ``/dev/shm`` and user, so the board is readable
wherever the ring is; a host-mate that cannot read it (no board yet, a stale one) asks the
store instead.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from lightning_wsync._control.untrusted import load_json, read_file, unexpected
from lightning_wsync._planes.base import HostNews as HostNews  # the plane interface's; kept importable here
from lightning_wsync._planes.base import Posted as Posted

log = logging.getLogger(__name__)

FILE = "board"


class Board:
    """The leader's end: posts news and beats (touches the file) on a thread of its own."""

    def __init__(self, directory: str, beat_s: float, rid: int) -> None:
        self.path = os.path.join(directory, FILE)
        self._beat_s = beat_s
        self._posted = HostNews(None, None)
        self._mates: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._write(self._posted)
        self._thread = threading.Thread(target=self._beat, name=f"wsync-relay-board-r{rid}", daemon=True)
        self._thread.start()

    def post(self, news: HostNews) -> None:
        """Tell the host-mates (rewrites the board when it changed)."""
        if news != self._posted:
            self._write(news)

    def passed_on(self, mates: dict[int, int]) -> None:
        """Say which note of each host-mate was passed on to the store (rid -> its sequence number)."""
        with self._lock:
            self._mates = dict(mates)
        self._write(None)

    def _write(self, news: HostNews | None) -> None:
        tmp = f"{self.path}.{threading.get_ident()}"
        with self._lock:
            news = self._posted if news is None else news
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump({**news._asdict(), "mates": {str(rid): seq for rid, seq in self._mates.items()}}, f)
                os.replace(tmp, self.path)  # a reader sees the old board or the new, never half of one
                self._posted = news
            except OSError as exc:  # the segment is being removed (stepping down): host-mates ask the store
                log.debug("relay board %s not written: %s", self.path, exc)

    def _beat(self) -> None:
        while not self._stop.wait(self._beat_s):
            try:
                os.utime(self.path)
            except OSError:
                return  # the pin directory is gone with the segment
            except Exception as exc:  # noqa: BLE001 - a board that stops beating reads as a dead leader
                unexpected(log, self._thread.name, exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def read_board(directory: str) -> Posted | None:
    """The board in ``directory`` (a leader's segment's pin directory), or None when there is none."""
    path = os.path.join(directory, FILE)
    try:  # read as hostile input (a FIFO, a symlink to /dev/zero: see read_file), then checked
        data, mtime = read_file(path)
        age_s = time.time() - mtime
        value = load_json(data, path)
        if not isinstance(value, dict):
            return None
        news = HostNews(_text(value.get("news")), _text(value.get("latest")), _text(value.get("sender")),
                        value.get("closed") is not False)  # fmt: skip
        return Posted(news, max(0.0, age_s), directory, _mates(value.get("mates")))
    except (OSError, ValueError, AttributeError):
        return None


def _mates(value: object) -> dict[int, int] | None:
    if not isinstance(value, dict):
        return None
    return {int(rid): seq for rid, seq in value.items() if isinstance(rid, str) and rid.isascii()
            and rid.isdigit() and len(rid) <= 18 and isinstance(seq, int)}  # fmt: skip


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None
