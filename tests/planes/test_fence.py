"""The pin protocol's fence is a real sequentially consistent one where Linux offers it
(issue 21 item 12: a lock round trip is not a StoreLoad fence on ARM)."""

from __future__ import annotations

import platform

import pytest

from lightning_wsync._planes.shm import fence


@pytest.mark.skipif(platform.system() != "Linux", reason="membarrier is a Linux system call")
def test_the_fence_is_membarrier_where_the_kernel_has_it():
    assert fence._MEMBARRIER is not None, "membarrier(GLOBAL_EXPEDITED) refused: kernel before 4.16 or seccomp"
    assert fence._MEMBARRIER() == 0
    assert fence.SEQUENTIALLY_CONSISTENT
    fence.fence()


def test_a_refused_membarrier_falls_back_to_the_lock(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(fence, "_MEMBARRIER", lambda: calls.append("membarrier") or -1)
    monkeypatch.setattr(fence, "lock_fence", lambda: calls.append("lock"))
    fence.fence()
    assert calls == ["membarrier", "lock"]
