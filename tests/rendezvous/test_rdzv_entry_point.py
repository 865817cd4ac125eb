"""The ``wsync`` backend registers through the ``torchrun.handlers`` entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, logging, sys
warnings = []

class Collect(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(f"{record.name}: {record.getMessage()}")

logging.getLogger().addHandler(Collect())
#FIRST_IMPORT
import torch.distributed.elastic.rendezvous  # runs the registry's entry-point discovery
from torch.distributed.elastic.rendezvous.api import (
    RendezvousParameters,
    rendezvous_handler_registry,
)

params = RendezvousParameters("wsync", "127.0.0.1:1", "exp1", 1, 1)
try:
    rendezvous_handler_registry.create_handler(params)
    error = None
except ValueError as exc:
    error = str(exc)
print(json.dumps({
    "error": error,
    "warnings": warnings,
    "heavy": sorted(m for m in ("lightning", "lightning.pytorch", "hydra") if m in sys.modules),
}))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "first_import",
    ["", "import lightning_wsync.rendezvous"],
    ids=["torch-first", "wsync-first"],
)
def test_wsync_backend_registers_in_a_fresh_interpreter(first_import: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.replace("#FIRST_IMPORT", first_import)],
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # Registered: the registry reached our creator, which rejected the conf (no role)
    # before touching the network. Unregistered would read "... is not registered".
    assert result["error"] is not None
    assert result["error"].startswith(
        "wsync rendezvous: --rdzv-conf has no 'role' key"
    ), result
    assert result["warnings"] == []
    assert result["heavy"] == []
