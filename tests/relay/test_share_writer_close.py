"""A trainer rank's (other than 0) close waits for its relay's threads within one bound, not one each.

Rank 1's exit ran ``ShareWriter.close()``, whose joins each had a bound of their own, one after
another (the checksum notes' thread, the stream head's, its feed's, then every delta stream's
helpers): threads slow to end at load 20-40 made that 20 s and more (issue 32, the sharded
scenario's "rank1 still running after 30 s"). Here the threads are made not to end (their
``join`` waits its whole timeout) and the close must take one bound.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from _sharded import sharded_model

from lightning_wsync import SenderConfig
from lightning_wsync._planes.delta.encode import DeltaStreams
from lightning_wsync._planes.shares import ShareWriter
from lightning_wsync._push.shares import prepare_shares

pytestmark = pytest.mark.timeout(60)


class _Stuck:
    """A delta stream whose encoding helpers never end: its join waits the whole timeout it is given."""

    def __init__(self) -> None:
        self.given: list[float] = []

    def join(self, timeout_s: float) -> None:
        self.given.append(timeout_s)
        time.sleep(timeout_s)


def test_delta_streams_close_waits_for_every_stream_within_one_bound() -> None:
    streams = DeltaStreams.__new__(DeltaStreams)  # only its close is under test
    stuck = [_Stuck() for _ in range(4)]
    streams._lock = threading.Lock()
    streams._streams = {(0, v, 1): s for v, s in enumerate(stuck, 1)}
    started = time.monotonic()
    streams.close(timeout_s=0.4)
    elapsed = time.monotonic() - started
    given = [t for s in stuck for t in s.given]
    # Before: 0.4 s each, 1.6 s in all. Now the first gets the bound and the others what is left of it.
    assert given[0] == pytest.approx(0.4, abs=0.05) and sum(given) <= 0.4 + 1e-6, given
    assert elapsed < 1.2, elapsed


def test_share_writer_close_waits_for_its_relay_threads_within_one_bound(server, port, monkeypatch) -> None:
    model = sharded_model()
    cfg = SenderConfig(job="xclose", timeout_s=3, heartbeat_timeout_s=10, delta="always")
    theirs = dataclasses.replace(prepare_shares(model, cfg, 1, 2), host="trainer-b")
    writer = ShareWriter(theirs, cfg)
    writer.relay(f"127.0.0.1:{port}", 1, cfg)  # a stream head (no sender: it relays to no leader yet)
    real_join = threading.Thread.join
    waited: list[tuple[str, float | None]] = []

    def stuck_join(self: threading.Thread, timeout: float | None = None) -> None:
        if self.name.startswith("wsync-relay"):  # the relay's threads: made not to end within any bound
            waited.append((self.name, timeout))
            time.sleep(timeout or 0.0)
            return
        real_join(self, timeout)

    bound = 1.0
    monkeypatch.setattr(threading.Thread, "join", stuck_join)
    started = time.monotonic()
    try:
        writer.close(timeout_s=bound)
    finally:
        monkeypatch.setattr(threading.Thread, "join", real_join)
    elapsed = time.monotonic() - started
    for thread in threading.enumerate():  # they were stopped: they end now that their joins are real
        if thread.name.startswith("wsync-relay"):
            thread.join(10)
    # The stream head's thread and its feed's each waited for: before, 1 s each (2 s and more in all).
    assert len(waited) >= 2, waited
    assert sum(t or 0.0 for _, t in waited) <= bound + 1e-6, waited
    assert elapsed < 1.8 * bound, (elapsed, waited)
