"""Checks that record decoders share (:mod:`lightning_wsync._control.records`), and
:class:`Complaints`, which reports a bad record once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping


class RecordShape(ValueError):
    """A parsed record is not of the shape its type expects (the message says what is wrong)."""

def fields(value: object, *names: str) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise RecordShape(f"not an object but {type(value).__name__}")
    missing = [n for n in names if n not in value]
    if missing:
        raise RecordShape(f"missing {', '.join(missing)}")
    return value


def as_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordShape(f"{what}={value!r:.40} is not an integer")
    return value


def as_float(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordShape(f"{what}={value!r:.40} is not a number")
    return float(value)


def as_str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise RecordShape(f"{what}={value!r:.40} is not a string")
    return value


def as_bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise RecordShape(f"{what}={value!r:.40} is not true/false")
    return value


def as_list(value: object, what: str) -> list[object]:
    if not isinstance(value, list):
        raise RecordShape(f"{what}={value!r:.40} is not a list")
    return value


def parse_counter(text: bytes | str) -> int | None:
    """The integer a counter key holds, or None when TCPStore's ``add`` would choke on it.

    ASCII digits with an optional ``-``, within int64; optionally followed by one space and
    up to 32 hex digits, the tag :meth:`Control.add` writes for a moment so that its
    compare-and-set tells its own write from an equal one (TCPStore's ``add`` reads that
    as the integer too: ``std::stoll`` stops at the space).
    """
    text = text.decode("ascii", "replace") if isinstance(text, bytes) else text
    number, _, tag = text.partition(" ")
    if tag and (len(tag) > 32 or not tag.isascii() or not all(c in "0123456789abcdef" for c in tag)):
        return None
    if text.endswith(" "):
        return None
    body = number[1:] if number.startswith("-") else number
    if not body.isdigit() or not body.isascii() or len(body) > 18:  # stays within int64
        return None
    return int(number)


class Complaints:
    """Reports each bad record once (per key and message), not at every poll that meets it."""

    def __init__(self, log: logging.Logger, who: str) -> None:
        self._log = log
        self._who = who
        self._said: dict[str, str] = {}
        self._lock = threading.Lock()

    def bad(self, key: str, exc: BaseException) -> None:
        with self._lock:
            if self._said.get(key) == str(exc):
                return
            if len(self._said) > 1024:  # bounded, whatever the store holds
                self._said.clear()
            self._said[key] = str(exc)
        self._log.error("%s ignores a bad record: %s", self._who, exc)

    def good(self, key: str) -> None:
        """``key`` read fine again: a later bad value is reported anew."""
        if key in self._said:
            with self._lock:
                self._said.pop(key, None)
