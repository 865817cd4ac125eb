"""A hosted store accepts on an IPv4 socket of its own: torch's IPv6 listener looks each
client up as ``::ffff:a.b.c.d``, which /etc/hosts does not answer, and its event loop waits for
DNS (5 s where the resolver loses the query) with every client's requests behind it."""

from __future__ import annotations

import gc
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_wsync._control.store import _ipv4_listener, connect_store, tcp_store

pytestmark = pytest.mark.timeout(60)

_LISTEN, _ESTABLISHED = "0A", "01"


def _sockets(port: int, state: str) -> dict[str, int]:
    """How many sockets with local ``port`` in ``state`` this machine has, per table (tcp: IPv4, tcp6: IPv6)."""
    found = {}
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        found[table] = sum(1 for r in rows if int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == state)
    return found


def test_a_hosted_store_listens_and_accepts_on_ipv4() -> None:
    server = tcp_store("127.0.0.1", 0, serve=True, timeout_s=10)
    assert _sockets(server.port, _LISTEN) == {"tcp": 1, "tcp6": 0}
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert server.get("k") == b"v"
    # The server's ends of its connections (its own client's and this one) are IPv4 sockets.
    assert _sockets(server.port, _ESTABLISHED) == {"tcp": 2, "tcp6": 0}


def test_a_name_with_ipv4_addresses_only_gets_the_ipv4_listener_and_an_ipv6_address_does_not() -> None:
    names = {family for family, *_ in socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)}
    if names == {socket.AF_INET}:
        listener = _ipv4_listener("localhost", 0)
        assert listener is not None and listener.family == socket.AF_INET
        listener.close()
    assert _ipv4_listener("::1", 0) is None


def test_the_listener_belongs_to_the_server_and_closes_with_it(port) -> None:
    server = tcp_store("127.0.0.1", port, serve=True, timeout_s=10, multi_tenant=False)
    assert _sockets(port, _LISTEN)["tcp"] == 1
    del server
    gc.collect()
    assert _sockets(port, _LISTEN) == {"tcp": 0, "tcp6": 0}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # free again: nothing kept it open


def test_a_port_another_server_holds_is_joined_as_a_client(port) -> None:
    other = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    handle = connect_store(f"127.0.0.1:{port}", serve=True, timeout_s=10, owner="test")
    assert not handle.is_server
    handle.store.set("k", "v")
    assert other.get("k") == b"v"


def test_a_second_host_of_the_same_port_in_one_process_shares_the_server(port) -> None:
    first = tcp_store("127.0.0.1", port, serve=True, timeout_s=10)
    second = tcp_store("127.0.0.1", port, serve=True, timeout_s=10)  # multi-tenant, as before
    second.set("k", "v")
    assert first.get("k") == b"v"
