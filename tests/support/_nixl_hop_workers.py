"""Child-process entry point of the NIXL relay hop's tests: one host leader of a chain
(its own host ring, a :class:`~lightning_wsync._planes.nixl.hop.ChainHop` from upstream)."""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
import time
from datetime import timedelta
from typing import Any


def slot_digest(buffer: Any) -> str:
    return hashlib.sha256(buffer.numpy().tobytes()).hexdigest()


def leader_main(store: str, job: str, secret: bytes, stream: int, rid: int, upstream: int | None, layout_json: str,
                results: Any, options: dict[str, Any]) -> None:  # fmt: skip
    """Lead host ``rid``: READ every version from ``upstream`` (None: the trainer) and report each
    one published here as ("version", rid, version, sha256 of its slot, whether it was READ while
    still being written upstream) until the store's key
    ``stop`` is set; then close and report ("closed", rid, threads left).

    ``options["chunk_delay_s"]``: sleep this long after each chunk lands (a slow reader), from
    version ``options["slow_from"]`` (default 1) on; ("reading", rid, version) is reported at
    the first chunk of each version.
    """
    os.environ["WSYNC_HOST_ID"] = f"nixl-hop-{rid}"
    import torch
    import torch.distributed as dist

    from lightning_wsync._control.manifest import Manifest
    from lightning_wsync._control.store import Control
    from lightning_wsync._planes.nixl.hop import ChainHop
    from lightning_wsync._planes.shm.ring import SnapshotRing
    from lightning_wsync._planes.shm.segment import ShmSegment, segment_name

    host, port = store.rsplit(":", 1)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    ctl = Control(client, job, secret)
    layout = Manifest.from_json(layout_json)
    name = segment_name(f"hoptest-{rid}-{secrets.token_hex(4)}", stream)
    segment = ShmSegment(name, layout.total_bytes, create=True, slots=2)
    ring = SnapshotRing(layout, segment=segment, device=torch.device("cpu"), slots=2,
                        lease_s=options.get("lease_s", 5.0))  # fmt: skip
    delay_s, slow_from = options.get("chunk_delay_s", 0.0), options.get("slow_from", 1)
    said: set[int] = set()

    class Hop(ChainHop):
        def after_chunk(self) -> None:
            version = self.reading
            if version is not None and version not in said:
                said.add(version)
                results.put(("reading", rid, version))
            if delay_s and version is not None and version >= slow_from:
                time.sleep(delay_s)

    hops: list[ChainHop] = []

    def accepted(version: int) -> None:
        ref = ring.find(version)
        assert ref is not None
        results.put(("version", rid, version, slot_digest(ring.buffers[ref.slot]), hops[0].from_draft))

    hop = Hop(ctl, layout, ring, segment, stream=stream, rid=rid, upstream=upstream,
              timeout_s=options.get("timeout_s", 10.0), on_accepted=accepted,
              on_rejected=lambda v, why: results.put(("rejected", rid, v, why)),
              chunk_bytes=options.get("chunk_bytes", 1 << 20))  # fmt: skip
    hops.append(hop)
    results.put(("ready", rid))
    while not ctl.has("stop"):
        time.sleep(0.05)
    hop.close()
    ring.close()
    segment.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith("wsync-")]
    results.put(("closed", rid, left))
