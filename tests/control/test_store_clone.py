"""Control.clone(): a thread's own connection, and what happens when one cannot be made."""

from __future__ import annotations

import gc
import logging
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_wsync._control import store as store_module
from lightning_wsync._control.store import Control
from lightning_wsync.testing.stores import host_store

pytestmark = pytest.mark.timeout(60)


def test_a_clone_that_cannot_connect_shares_the_connection_and_says_so_once(port, monkeypatch, caplog) -> None:
    monkeypatch.setattr(store_module, "_CLONE_WARNED", [])
    server = host_store("127.0.0.1", port, timeout_s=5)
    ctl = Control(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1)), "clone")
    own = ctl.clone()
    assert own is not ctl
    own.set_text("k", "v")
    assert ctl.get_text("k") == "v"
    del server, own
    gc.collect()  # the server stops with its last reference
    caplog.set_level(logging.WARNING, logger="lightning_wsync")
    assert ctl.clone() is ctl and ctl.clone() is ctl
    said = [r.getMessage() for r in caplog.records if "second connection to the store failed" in r.getMessage()]
    assert len(said) == 1, said
    assert "raise timeout_s" in said[0]
