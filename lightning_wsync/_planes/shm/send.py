"""The shared-memory plane's send side: receivers on this host read the sender's ring
themselves (woken by the writer), so all this side does is publish each version's
bucket checksums for receivers that verify."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_wsync._control import keys
from lightning_wsync._control.store import Control
from lightning_wsync._planes.base import Delivery, Peer
from lightning_wsync._planes.shm.ring import SnapshotRing


class ShmSendPlane:
    """Same-host receivers of a ring in shared memory."""

    def __init__(self, control: Control, ring: SnapshotRing) -> None:
        self._ctl = control
        self._ring = ring
        self._unsummed: int | None = None  # the newest version, published while no live receiver verified

    def sync(self, live: Sequence[Peer], gone: Sequence[Peer], retired: Sequence[Peer]) -> None:
        """Readers pin slots themselves (a dead reader's pin expires); a receiver that verifies and joined after
        the newest push gets that version's checksums now, not only with the next push."""
        version = self._unsummed
        if version is not None and any(p.verify for p in live):
            self._unsummed = None
            self._publish_sums(version)

    def published(self, version: int, live: Sequence[Peer]) -> None:
        """Publish the checksums, after the version is out so receivers that do not verify are not delayed."""
        if not any(p.verify for p in live):
            self._unsummed = version
            return
        self._unsummed = None
        self._publish_sums(version)

    def _publish_sums(self, version: int) -> None:
        ref = self._ring.find(version)
        lease = None if ref is None else self._ring.acquire(ref)
        if lease is None:  # already overwritten by the next push
            return
        try:
            sums = self._ring.checksums(lease)
        finally:
            lease.release()
        if sums is not None:
            self._ctl.set_json(keys.version_sums(version), {"version": version, "sums": sums})

    def deliveries(self, version: int, peers: Sequence[Peer]) -> dict[str, Delivery]:
        return {}  # always the whole version, copied from the ring

    def failure(self, rid: int, version: int) -> str | None:
        return None

    @property
    def superseded(self) -> int:
        return 0

    def stop(self) -> None:
        pass

    def close(self, deadline: float) -> list[str]:
        return []
