"""With WSYNC_SECRET, the rendezvous state torch pickles on the store is signed and verified.

A forged state on the shared store is a pickle that would run code in every torchrun
agent that unpickles it; with a secret set the agent refuses it before unpickling.
"""

from __future__ import annotations

import base64
import pickle
from pathlib import Path

import pytest

from lightning_wsync.testing.stores import host_store

from ._rdzv_helpers import Events, Job, Jobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


class _Payload:
    """Unpickling this creates ``path``: proof that forged state was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def test_forged_state_is_refused_before_unpickling(jobs: Jobs, events: Events, port: int, tmp_path: Path) -> None:
    server = host_store("127.0.0.1", port, timeout_s=30)
    marker = tmp_path / "unpickled"
    forged = base64.b64encode(pickle.dumps(_Payload(marker))).decode()
    server.set("torch.rendezvous.exp1.trainer.l0", forged)

    def start(name: str, secret: str) -> Job:
        env = jobs.env()
        env["WSYNC_SECRET"] = secret
        return jobs.torchrun(
            name, port=port, conf="role=trainer,is_host=false", script="probe_worker.py",
            script_args=["--out", str(tmp_path), "--tag", name], nproc=1, env=env,
        )  # fmt: skip

    attacked = start("attacked", "s3cret")
    assert attacked.wait(timeout_s=90) != 0
    assert not marker.exists(), "the forged rendezvous state was unpickled"
    assert "refused the state at store key 'torch.rendezvous.exp1.trainer.l0': it is not signed" in attacked.log()
    assert events.select("start") == []

    # Agents that share the secret sign and verify their own state: the next launch
    # (a fresh launch, since the forged one never closed: reset it) forms its group.
    server.set("torch.rendezvous.exp1.trainer.l0", "Y2FuaW1hZGFt")  # torch's "no state" sentinel
    ok = start("ok", "s3cret")
    assert ok.wait(timeout_s=90) == 0, ok.tail()
    assert [r["tag"] for r in events.select("exit")] == ["ok"]
    raw = server.get("torch.rendezvous.exp1.trainer.l0")
    assert base64.b64decode(raw).startswith(b"wsync-signed-state-v1\0")
    del server
