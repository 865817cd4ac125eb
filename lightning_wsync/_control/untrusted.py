"""The one boundary for values lightning_wsync reads from places others can write: a store
key that is not a signed record (counters, notes), and the files a relay leader keeps on
its host (the board, its host-mates' notes).

Whatever such a place holds, a reader gets a value or :class:`Untrusted` (a ``ValueError``
naming what was wrong), never another exception: a ``"²"`` that ``str.isdigit()`` accepts
and ``int()`` refuses, JSON nested deep enough to exhaust the recursion limit, a FIFO that
would block ``open()`` forever, a symlink to ``/dev/zero`` that would be read without end.
:class:`~lightning_wsync._control.checks.Complaints` reports each bad value once;
:func:`unexpected` is what a background thread calls with an exception nobody expected,
before it goes on serving.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading

from lightning_wsync._control.checks import parse_counter
from lightning_wsync._control.signing import short

__all__ = ["FILE_LIMIT_BYTES", "Untrusted", "counter", "load_json", "read_file", "unexpected"]

FILE_LIMIT_BYTES = 64 * 1024  # a board or a note is a few hundred bytes; a sealed state record a few KiB
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class Untrusted(ValueError):
    """A value read from the store or the host is not what lightning_wsync writes there."""


def counter(text: str | bytes, what: str) -> int:
    """The integer of an unsigned counter (``member/<rid>/hb``, ``shard_written/<rank>``), or
    :class:`Untrusted`: ASCII digits only, within int64 (``"²"`` and ``"1e9"`` are refused)."""
    count = parse_counter(text)
    if count is None:
        raise Untrusted(f"{what} holds {short(text)}, not an integer; only lightning_wsync should write it")
    return count


def load_json(data: bytes | str, what: str) -> object:
    """``data`` parsed as JSON, or :class:`Untrusted` (also for nesting deep enough to overflow
    the parser's recursion, which ``json`` reports as ``RecursionError``)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise Untrusted(f"{what} holds {short(data if isinstance(data, str) else bytes(data))}, not JSON "
                        f"({type(exc).__name__})") from None  # fmt: skip


def read_file(path: str, *, limit_bytes: int = FILE_LIMIT_BYTES) -> tuple[bytes, float]:
    """The bytes of the regular file at ``path`` and its modification time (``time.time()`` clock).

    Opened without following a symlink and without blocking (a FIFO or a device never hangs
    the reader), checked to be a regular file on the open descriptor, read up to
    ``limit_bytes``. Raises ``FileNotFoundError`` when there is no such file (the caller's
    "gone"), :class:`Untrusted` for anything else that is not such a file.
    """
    try:
        fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Untrusted(f"{path} is a symlink; it is not followed") from None
        raise Untrusted(f"{path} cannot be opened ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Untrusted(f"{path} is not a regular file (mode {oct(info.st_mode)})")
        if info.st_size > limit_bytes:
            raise Untrusted(f"{path} holds {info.st_size} bytes, more than {limit_bytes}")
        data = os.read(fd, limit_bytes + 1)
        if len(data) > limit_bytes:  # it grew since fstat
            raise Untrusted(f"{path} holds more than {limit_bytes} bytes")
        return data, info.st_mtime
    except OSError as exc:
        raise Untrusted(f"{path} cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)


_said: dict[str, str] = {}
_said_lock = threading.Lock()


def unexpected(log: logging.Logger, thread: str, exc: BaseException) -> None:
    """Report an exception a background thread did not expect: with its traceback the first
    time per thread and message, at DEBUG after that (the thread goes on serving)."""
    text = f"{type(exc).__name__}: {exc}"[:300]
    with _said_lock:
        first = _said.get(thread) != text
        if first:
            if len(_said) > 1024:
                _said.clear()
            _said[thread] = text
    if first:
        log.error("%s: unexpected %s; it goes on", thread, text, exc_info=exc)
    else:
        log.debug("%s: unexpected %s again", thread, text)
