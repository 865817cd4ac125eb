"""The handler in-process, against a real TCPStore on 127.0.0.1 (no torchrun)."""

from __future__ import annotations

import gc
import os
import socket
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousParameters,
)

from lightning_wsync.rendezvous import create_handler
from lightning_wsync.rendezvous._handler import WsyncRendezvousHandler
from lightning_wsync.rendezvous._store import names_this_machine

from ._rdzv_helpers import wait_until


def _params(port: int, conf: str, rdzv_id: str = "exp1") -> RendezvousParameters:
    config = dict(kv.split("=", 1) for kv in conf.split(","))
    return RendezvousParameters(
        "wsync", f"127.0.0.1:{port}", rdzv_id, 1, 1, timeout=900, **config
    )


def _handler(port: int, conf: str, rdzv_id: str = "exp1") -> WsyncRendezvousHandler:
    handler = create_handler(_params(port, conf, rdzv_id))
    assert isinstance(handler, WsyncRendezvousHandler)
    return handler


def _host_store(port: int) -> dist.TCPStore:
    """A store at the endpoint, as `lightning-wsync store` or a trainer agent hosts it."""
    return dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=10),
    )


@pytest.fixture
def store(port: int) -> Iterator[dist.TCPStore]:
    yield _host_store(port)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_trainer_hosts_store_exports_env_and_restores_it(port: int) -> None:
    handler = _handler(port, "role=trainer")
    try:
        assert _listening(port)
        assert handler.get_backend() == "wsync"
        assert handler.get_run_id() == "exp1"
        assert handler.inner_run_id == "exp1.trainer.l0"
        assert "WSYNC_STORE" not in os.environ
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert {
            k: os.environ.get(k) for k in ("WSYNC_STORE", "WSYNC_JOB", "WSYNC_ROLE")
        } == {
            "WSYNC_STORE": f"127.0.0.1:{port}",
            "WSYNC_JOB": "exp1",
            "WSYNC_ROLE": "trainer",
        }
        # Workers connect to a fresh per-round store hosted here; the agent uses it too.
        assert info.bootstrap_store_info is not None
        assert info.bootstrap_store_info.master_port not in (port, 0)
        assert _listening(info.bootstrap_store_info.master_port)
        info.store.set("k", "v")
        assert info.store.get("k") == b"v"
        assert handler.num_nodes_waiting() == 0
        assert not handler.is_closed()
    finally:
        assert handler.shutdown()
    assert "WSYNC_STORE" not in os.environ and "WSYNC_ROLE" not in os.environ
    assert handler.is_closed()


@pytest.mark.timeout(60)
def test_relaunch_with_same_id_moves_to_next_launch(
    store: dist.TCPStore, port: int
) -> None:
    first = _handler(port, "role=rollout")
    try:
        first.next_rendezvous()
        assert first.inner_run_id == "exp1.rollout.l0"
    finally:
        first.shutdown()  # closes exp1.rollout.l0 for good
    second = _handler(port, "role=rollout")
    try:
        assert second.inner_run_id == "exp1.rollout.l0"
        info = second.next_rendezvous()
        assert second.inner_run_id == "exp1.rollout.l1"
        assert (info.rank, info.world_size) == (0, 1)
        assert store.get("wsync.rdzv/exp1/rollout/launch") == b"1"
    finally:
        second.shutdown()
    # The other role is untouched by the rollout's launches.
    trainer = _handler(port, "role=trainer")
    try:
        trainer.next_rendezvous()
        assert trainer.inner_run_id == "exp1.trainer.l0"
    finally:
        trainer.shutdown()


@pytest.mark.timeout(60)
def test_store_host_ending_first_is_not_a_crash(port: int) -> None:
    store = _host_store(port)
    handler = _handler(port, "role=rollout")
    try:
        handler.next_rendezvous()
        del store
        gc.collect()  # that was the last reference: the server stops
        assert not _listening(port)
        # The inner handler serves its state from a 1 s cache; the loss shows after it.
        wait_until(
            "the handler to notice the store is gone", handler.is_closed, timeout_s=10
        )
        assert handler.num_nodes_waiting() == 0
        with pytest.raises(
            RendezvousClosedError, match=r"control-plane store at 127.0.0.1:\d+ is gone"
        ):
            handler.next_rendezvous()
    finally:
        assert handler.shutdown()
    assert "WSYNC_STORE" not in os.environ


@pytest.mark.timeout(60)
def test_is_host_true_on_a_taken_port_says_how_to_join(
    store: dist.TCPStore, port: int
) -> None:
    with pytest.raises(
        RendezvousConnectionError,
        match=r"cannot host the store at 127.0.0.1:\d+ \(is_host=true\).*is_host=false",
    ):
        _handler(port, "role=trainer,is_host=true")


@pytest.mark.timeout(60)
def test_trainer_joins_a_standalone_store_as_client(
    store: dist.TCPStore, port: int
) -> None:
    for conf in ("role=trainer", "role=trainer,is_host=false"):
        handler = _handler(port, conf)
        try:
            handler.next_rendezvous()
            assert store.check(["wsync.rdzv/exp1/trainer/launch"])
        finally:
            handler.shutdown()


@pytest.mark.timeout(60)
def test_rollout_without_a_store_times_out_with_a_fix(port: int) -> None:
    with pytest.raises(
        RendezvousConnectionError,
        match=r"no store listens at 127.0.0.1:\d+ after 1 s.*join_timeout",
    ):
        _handler(port, "role=rollout,join_timeout=1")


def test_names_this_machine_tells_local_addresses_apart() -> None:
    assert names_this_machine("127.0.0.1")
    assert names_this_machine("localhost")
    assert not names_this_machine("192.0.2.1")  # TEST-NET-1: never assigned
    assert not names_this_machine("no-such-host.invalid")


@pytest.mark.timeout(60)
def test_trainer_away_from_the_endpoint_does_not_host(port: int) -> None:
    # A trainer node on another machine must join the endpoint's store, not serve its own.
    with pytest.raises(
        RendezvousConnectionError, match=r"no store listens at 192.0.2.1:\d+ after 1 s"
    ):
        create_handler(
            RendezvousParameters(
                "wsync",
                f"192.0.2.1:{port}",
                "exp1",
                1,
                1,
                role="trainer",
                join_timeout="1",
            )
        )
    assert not _listening(port)


def test_rdzv_id_with_a_slash_is_rejected(port: int) -> None:
    # Rejected before any store is contacted (none listens at this port).
    with pytest.raises(
        ValueError,
        match=r"--rdzv-id 'a/b' must be non-empty and contain no '/'.*--rdzv-id=exp1",
    ):
        _handler(port, "role=rollout", rdzv_id="a/b")


@pytest.mark.timeout(60)
def test_store_host_lingers_while_other_agents_use_it(port: int) -> None:
    trainer = _handler(port, "role=trainer,linger_timeout=2")
    rollout = _handler(port, "role=rollout")
    started = time.monotonic()
    assert trainer.shutdown()
    # The rollout agent never released the store: the host waited its full bound.
    assert time.monotonic() - started >= 2
    del trainer  # as the agent process ends, so does the store it hosts
    gc.collect()
    assert not _listening(port)
    assert rollout.shutdown()  # finds the store gone: nothing to close, no error


@pytest.mark.timeout(60)
def test_store_host_ends_as_soon_as_other_agents_release_it(port: int) -> None:
    trainer = _handler(port, "role=trainer,linger_timeout=30")
    rollout = _handler(port, "role=rollout")
    assert rollout.shutdown()
    started = time.monotonic()
    assert trainer.shutdown()
    assert time.monotonic() - started < 15
