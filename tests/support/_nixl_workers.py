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
    watch_hop(name, results, options)
    forward_logs = options.pop("forward_logs", False)
    if forward_logs:
        forward_log(name, results)
    report = options.pop("report_left", False)
    from _workers import receiver_main

    receiver_main(store, job, name, spec, results, options)
    if report:
        report_left(name, results)


def watch_hop(name: str, results: Any, options: dict[str, Any]) -> None:
    """This receiver's relay hop over NIXL, if it leads its host, says ("hop-reading", name, version, its rid,
    its upstream's rid or None, the granted slot, its sequence) at the first chunk of each version, and
    ("hop-published", name, version, slot, sequence) as it publishes one (tests of hops' failures).

    ``options["hop_chunk_delay_s"]``: sleep this long after each chunk of versions ``hop_slow_from`` (default
    2) and on, or of ``hop_slow_versions`` only. ``options["hop_hold"]`` (an event) with ``hop_hold_version``:
    after the first chunk of that version READ from another leader (not the trainer), say ("hop-held", name)
    and wait for the event (at most 120 s): a hop slower than its upstream's lease while everything else
    (its heartbeats, its host) goes on."""
    from lightning_wsync._planes.nixl.hop import ChainHop
    from lightning_wsync._planes.nixl.lend import HopOwner

    delay_s = options.pop("hop_chunk_delay_s", 0.0)
    slow_from, slow_versions = options.pop("hop_slow_from", 2), options.pop("hop_slow_versions", None)
    hold, hold_version = options.pop("hop_hold", None), options.pop("hop_hold_version", None)
    said: set[int] = set()
    granted: dict[int, Any] = {}  # version -> its grant

    take, end = ChainHop._take, HopOwner.end

    def _take(self: ChainHop, up: Any, grant: Any, box: Any) -> None:
        granted[grant.version] = grant
        take(self, up, grant, box)

    def after_chunk(self: ChainHop) -> None:
        version = self.reading
        if version is None:
            return
        if version not in said:
            said.add(version)
            grant = granted.get(version)
            slot, seq = (None, None) if grant is None else (grant.slot, grant.seq)
            results.put(("hop-reading", name, version, self._rid, self._upstream, slot, seq))
            if hold is not None and version == hold_version and self._upstream is not None:
                results.put(("hop-held", name))
                hold.wait(120)
        slow = version >= slow_from if slow_versions is None else version in slow_versions
        if delay_s and slow:
            time.sleep(delay_s)

    def _end(self: HopOwner, ref: Any) -> None:
        end(self, ref)
        if ref is not None:
            results.put(("hop-published", name, ref.version, ref.slot, ref.seq))

    ChainHop._take = _take  # type: ignore[method-assign]
    ChainHop.after_chunk = after_chunk  # type: ignore[method-assign]
    HopOwner.end = _end  # type: ignore[method-assign]


def forward_log(name: str, results: Any) -> None:
    """Every record of the NIXL plane's loggers, DEBUG and up, as ("log", name, level, message, its time.time())."""
    import logging

    class Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            results.put(("log", name, record.levelname, record.getMessage(), record.created))

    logger = logging.getLogger("lightning_wsync._planes.nixl")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Forward())


def report_left(name: str, results: Any) -> None:
    """Once the receiver closed: ("left", name, wsync threads still running, NIXL agents still open)."""
    import gc

    from lightning_wsync._planes.nixl.agent import Agent

    for t in threading.enumerate():
        if t.name.startswith("wsync-"):
            t.join(timeout=10)
    threads = [t.name for t in threading.enumerate() if t.name.startswith("wsync-") and t.is_alive()]
    gc.collect()
    agents = [a.name for a in gc.get_objects() if type(a) is Agent and a._nixl is not None]
    results.put(("left", name, threads, agents))


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


def sharded_receiver_main(
    store: str, job: str, name: str, spec: tuple[str, int], results: Any, options: dict[str, Any]
) -> None:
    """A receiver on a simulated host of its own, of a sharded sender whose ranks relay their shares over
    NIXL (tests/nixl/test_nixl_sharded.py). Says ("hop-reading", name, version, rank, its rid, its upstream's
    rid or None) at the first chunk of each version its hop READs of each rank's stream; with
    ``options["slow_rank"]`` and ``options["slow_versions"]``, that rank's hops sleep ``options["delay_s"]``
    after each chunk of those versions. Then as ``receiver_main``; once the sender closed and the receiver is
    closed: ("left", name, wsync threads still running, NIXL agents still open)."""
    os.environ["WSYNC_HOST_ID"] = f"nixl-test-{name}"
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for every thread's stack when stuck

    from _workers import receiver_main

    from lightning_wsync._control.keys import STREAM_RANKS
    from lightning_wsync._planes.nixl.hop import ChainHop

    slow_rank, slow_versions = options.pop("slow_rank", None), set(options.pop("slow_versions", ()))
    delay_s = options.pop("delay_s", 0.0)
    said: set[tuple[int, int]] = set()

    def after_chunk(self: ChainHop) -> None:
        version, rank = self.reading, self._stream % STREAM_RANKS
        if version is None:
            return
        if (version, rank) not in said:
            said.add((version, rank))
            results.put(("hop-reading", name, version, rank, self._rid, self._upstream))
        if rank == slow_rank and version in slow_versions:
            time.sleep(delay_s)

    ChainHop.after_chunk = after_chunk  # type: ignore[method-assign]
    receiver_main(store, job, name, spec, results, options)  # returns once the sender closed, receiver closed
    report_left(name, results)
