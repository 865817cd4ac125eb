"""A control-plane store hosted the way the package hosts one, for tests and the bench."""

from __future__ import annotations

import torch.distributed as dist

from lightning_wsync._control.store import tcp_store


def host_store(host: str, port: int, *, timeout_s: float, multi_tenant: bool = False) -> dist.TCPStore:
    """A TCPStore served at ``host:port`` (``port`` 0: a free one, read back as ``.port``).

    Hosted as a sender or the rendezvous hosts one: at an IPv4 address the server accepts on
    an IPv4 socket, so a new client never holds every request behind a DNS lookup
    (docs/control-plane.md, "Connects that take 5 s"). Not multi-tenant unless asked: a
    sender in the same process then joins it as a client, as one on another host would.
    """
    return tcp_store(host, port, serve=True, timeout_s=timeout_s, multi_tenant=multi_tenant)
