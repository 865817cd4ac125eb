"""A sender switch never holds up ``update()``: the old plane is closed outside the apply
lock (issue 21, item 12: a relay host's old thread was joined under it, up to 10 s)."""

from __future__ import annotations

import threading
import time

import pytest
from _workers import digest, mixed_model, mutate

from lightning_wsync import WeightReceiver, WeightSender
from lightning_wsync._planes.shm.source import SharedMemorySource

SLOW_CLOSE_S = 3.0


@pytest.mark.timeout(60)
def test_update_is_not_held_up_while_the_old_plane_closes(port, monkeypatch):
    closing = threading.Event()
    original = SharedMemorySource.close

    def slow_close(self: SharedMemorySource) -> None:
        closing.set()
        time.sleep(SLOW_CLOSE_S)  # a plane whose close takes long (adversarial timing, not synchronisation)
        original(self)

    store = f"127.0.0.1:{port}"
    keeper = WeightSender(mixed_model(), store=store, job="keeper")  # hosts the store across senders
    model = mixed_model(1)
    dst = mixed_model(2)
    try:
        with WeightReceiver(dst, store=store, job="switch", timeout_s=20) as receiver:
            first = WeightSender(model, store=store, job="switch")
            first.push(1)
            assert receiver.wait_for_version(1, timeout_s=20) == 1
            first.close(final=False)
            monkeypatch.setattr(SharedMemorySource, "close", slow_close)
            with WeightSender(model, store=store, job="switch") as second:
                mutate(model, 2)
                second.push(2)
                assert closing.wait(timeout=20), "the receiver never switched to the second sender"
                started = time.monotonic()
                receiver.update()  # before: blocked on the apply lock for the whole close
                took = time.monotonic() - started
                assert took < SLOW_CLOSE_S / 2, f"update() waited {took:.2f} s for the old plane to close"
                assert receiver.wait_for_version(2, timeout_s=20) == 2
                assert digest(dst) == digest(model)
    finally:
        keeper.close()
