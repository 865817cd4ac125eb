"""Child-process entry points of the NIXL plane's tests: receivers and a sender on other
(simulated) hosts: each sets its own ``WSYNC_HOST_ID`` before it starts."""

from __future__ import annotations

import os
import threading
import time
from typing import Any


def remote_receiver_main(
    store: str, job: str, name: str, spec: tuple[str, int], results: Any, options: dict[str, Any]
) -> None:
    """A receiver whose host id differs from the sender's (so it takes the cross-host plane).

    ``options["stall_first_chunk_s"]``: after the first chunk of the first READ above
    version 1, sleep this long (a reader slower than the owner's lease), saying so first.
    """
    os.environ["WSYNC_HOST_ID"] = f"nixl-test-{name}"
    stall_s = options.pop("stall_first_chunk_s", None)
    if stall_s is not None:
        from lightning_wsync._planes.nixl.receive import NixlReader

        stalled: list[bool] = []

        def after_chunk(self: NixlReader) -> None:
            if not stalled and self.version is not None:
                stalled.append(True)
                results.put(("stalling", name))
                time.sleep(stall_s)

        NixlReader.after_chunk = after_chunk  # type: ignore[method-assign]
    hop_delay_s = options.pop("hop_chunk_delay_s", None)
    if hop_delay_s is not None:
        slow_hop(name, results, hop_delay_s, options.pop("hop_slow_from", 2))
    from _workers import receiver_main

    receiver_main(store, job, name, spec, results, options)


def slow_hop(name: str, results: Any, delay_s: float, slow_from: int) -> None:
    """This receiver's relay hop over NIXL, if it leads its host, sleeps ``delay_s`` after each chunk
    of versions ``slow_from`` and on, having said ("hop-reading", name, version, its rid, its
    upstream's rid or None) at the first chunk of each version (tests of a chain's failures)."""
    from lightning_wsync._planes.nixl.hop import ChainHop

    said: set[int] = set()

    def after_chunk(self: ChainHop) -> None:
        version = self.reading
        if version is None or version < slow_from:
            return
        if version not in said:
            said.add(version)
            results.put(("hop-reading", name, version, self._rid, self._upstream))
        time.sleep(delay_s)

    ChainHop.after_chunk = after_chunk  # type: ignore[method-assign]


def remote_sender_main(port: int, job: str, spec: tuple[str, int], commands: Any, results: Any) -> None:
    """Host the store on another host: push each version asked for (reporting its digest) until killed."""
    os.environ["WSYNC_HOST_ID"] = "nixl-test-sender"
    from _workers import build, digest, mutate

    from lightning_wsync import WeightSender

    model = build(spec)
    sender = WeightSender(model, store=f"127.0.0.1:{port}", job=job, transport="nixl", cross_host="star", timeout_s=5)
    results.put(("ready", "sender"))
    while True:
        version = commands.get()
        mutate(model, version)
        results.put(("pushing", "sender", version, digest(model)))
        sender.push(version)
    threading.Event().wait()
