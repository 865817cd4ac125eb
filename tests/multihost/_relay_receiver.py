"""A receiver process on a simulated host: applies every version it can, reports each with its digest."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os

import torch
from _relaylog import relay_info

from lightning_wsync import WeightReceiver, WeightSyncClosedError, WeightSyncTimeoutError
from lightning_wsync.testing.models import ModelSpec, build_model, digest, spec_for_size


def emit(path: str, **fields: object) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(fields) + "\n").encode())
    finally:
        os.close(fd)


def corrupt_rebuilt(version: int) -> None:
    """Flip one bit of the first bucket this process rebuilds for ``version`` (as wire corruption would)."""
    from lightning_wsync._planes.relay.leader import hop as relay_hop

    class Corrupting(relay_hop.DeltaDecoder):
        def decode_bucket(self, payload, base, out):  # type: ignore[no-untyped-def]
            decoded = super().decode_bucket(payload, base, out)
            if self.header.version == version and decoded.bucket == 0:
                out[self.layout.buckets[0][0]] ^= 0x10
            return decoded

    relay_hop.DeltaDecoder = Corrupting  # type: ignore[misc]


def slow_connect(seconds: float) -> None:
    """Make this leader's hops downstream connect ``seconds`` late, and its forwarding not wait
    for them: every version that goes by while they connect must be resent once they are up."""
    from lightning_wsync._planes.relay import down as relay_down

    connect = relay_down.Downstream._connect

    def late(self, backend, addr):  # type: ignore[no-untyped-def]
        self._closed.wait(seconds)
        connect(self, backend, addr)

    relay_down.Downstream._connect = late  # type: ignore[method-assign]
    relay_down._DOWNSTREAM_CONNECT_S = 0.0


def main() -> int:
    relay_info()
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--size-mb", type=float, required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--spec", default=None, help="d_model,vocab,layers (instead of --size-mb)")
    parser.add_argument("--wire-dtype", default=None, help="digest as cast to this dtype (the sender's dtype=)")
    parser.add_argument("--corrupt-version", type=int, default=None,
                        help="as a host leader, flip a bit of this version while rebuilding it from a delta")
    parser.add_argument("--slow-connect-s", type=float, default=None,
                        help="as a host leader, connect each hop downstream this late (see slow_connect)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.slow_connect_s is not None:
        slow_connect(args.slow_connect_s)
    if args.corrupt_version is not None:
        corrupt_rebuilt(args.corrupt_version)
    spec = spec_for_size(args.size_mb) if args.spec is None else ModelSpec(*(int(x) for x in args.spec.split(",")))
    model = build_model(spec, seed=None)
    wire = None if args.wire_dtype is None else getattr(torch, args.wire_dtype)
    with WeightReceiver(
        model, store=args.store, job=args.job, name=args.name, timeout_s=args.timeout_s
    ) as receiver:
        emit(
            args.events,
            event="ready",
            name=args.name,
            pid=os.getpid(),
            rid=receiver.rid,
        )
        held = -1
        while True:
            try:
                held = receiver.wait_for_version(held + 1, timeout_s=args.timeout_s)
            except WeightSyncClosedError:
                return 0
            except WeightSyncTimeoutError:
                # Where every thread was (a leader that never joined a hop: issue 32), then the error.
                faulthandler.dump_traceback(all_threads=True)
                raise
            emit(args.events, event="applied", name=args.name, pid=os.getpid(), version=held,
                 digest=digest(model, wire))  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
