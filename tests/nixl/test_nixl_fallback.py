"""NIXL installed but unable to start here: its UCX backend refuses to create a context when
``UCX_TLS`` asks for transports this host lacks (``rc``: RDMA verbs, and no RDMA NIC here).
``transport='auto'`` falls back to gloo links and says which and why, once; ``transport='nixl'``
fails with an error naming the parameter, its value and the fix. In a fresh process (UCX reads
its settings when a context is created; the plane probes NIXL once per process)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

_ABSENT = importlib.util.find_spec("nixl_cu12") is None
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120),
              pytest.mark.skipif(_ABSENT, reason="NIXL is not installed (the [nixl] extra)")]  # fmt: skip

_SCRIPT = """
import logging, sys
import torch
from lightning_wsync import WeightSender
from lightning_wsync.errors import WeightSyncConfigError

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(name)s %(message)s")
model = torch.nn.Linear(4, 4)
with WeightSender(model, store="127.0.0.1:0", job="fallback", transport="auto", cross_host="star") as sender:
    sender.push(1)
try:
    WeightSender(model, store="127.0.0.1:0", job="fallback2", transport="nixl", cross_host="star")
except WeightSyncConfigError as exc:
    print("ERROR", exc)
else:
    print("ERROR none")
"""


def test_nixl_that_cannot_start_falls_back_to_gloo_under_auto_and_fails_clearly_under_nixl():
    env = {**os.environ, "UCX_TLS": "rc", "NIXL_LOG_LEVEL": "WARN", "WSYNC_HOST_ID": "nixl-fallback"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=100, env=env,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    said = [line for line in out if "receivers on other hosts" in line]
    # Which (gloo links) and why (NIXL's agent did not start, with the UCX setting that stopped it), once.
    assert len(said) == 1, out
    assert "transport='auto', cross_host='star': receivers on other hosts get gloo links (NIXL agent" in said[0]
    assert "could not start" in said[0] and "UCX settings: UCX_TLS=rc" in said[0], said
    (error,) = [line for line in out if line.startswith("ERROR")]
    assert "WeightSender: transport='nixl', but NIXL agent" in error and "UCX_TLS=rc" in error, error
    assert error.endswith("or use transport='auto'"), error
    assert "UCX logs the cause)" in error and "no usable transports/devices (asked rc" in done.stdout + done.stderr
