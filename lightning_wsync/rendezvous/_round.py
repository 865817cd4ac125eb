"""Per-round bootstrap: the store a role's workers and agents meet on in one round.

torch 2.13 gets this wrong for a group whose membership changes: it publishes
``MASTER_ADDR``/``MASTER_PORT`` only when a node first becomes rank 0 (a node joining
a later round blocks reading them), and its rank-0 agent serves one store to the
workers of every round, so a restarted worker group reads the previous group's gloo
addresses and fails to connect. Here the rank-0 agent hosts a fresh store every
round and publishes its address in that round's keys; torchrun's agent keeps its own
keys (rank assignment, exit barrier) on it too, not on the shared store, so an agent
whose shared-store host ended first still finishes cleanly.
"""

from __future__ import annotations

import json
from datetime import timedelta

from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

from lightning_wsync._control import keys
from lightning_wsync._control.store import tcp_store

__all__ = ["RoundStore"]



class RoundStore:
    """The store of the current round: hosted here on rank 0, a client elsewhere.

    Args:
        timeout: timeout of one operation on it (the ``read_timeout``).
    """

    def __init__(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._store: TCPStore | None = None

    def next_round(
        self, info: RendezvousInfo, use_agent_store: bool
    ) -> tuple[RendezvousStoreInfo, Store]:
        """Set up the round just formed.

        Args:
            info: what the inner c10d handler returned for this round.
            use_agent_store: torch's agent-store sharing (off with
                ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, where worker rank 0 hosts the
                workers' store itself and the agent keeps using the shared store).

        Returns:
            The bootstrap address for the workers and the store for torchrun's agent.
        """
        # The previous round's workers are stopped: drop its store first.
        self._store = None
        round_store = info.store
        if info.rank == 0:
            inner = info.bootstrap_store_info
            assert inner is not None, "DynamicRendezvousHandler returns bootstrap info"
            addr, port = inner.master_addr, inner.master_port
            if use_agent_store:
                server = tcp_store(addr, 0, serve=True, timeout_s=self._timeout.total_seconds())
                self._store, port = server, server.port
            round_store.set(keys.ROUND_BOOTSTRAP, json.dumps({"addr": addr, "port": port}))
            # Unblocks a joining node whose inner handler waits for the stock keys.
            round_store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, addr)
            round_store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(port))
        else:
            published = json.loads(round_store.get(keys.ROUND_BOOTSTRAP))
            addr, port = str(published["addr"]), int(published["port"])
            if use_agent_store:
                self._store = tcp_store(addr, port, serve=False, timeout_s=self._timeout.total_seconds())
        bootstrap = RendezvousStoreInfo(master_addr=addr, master_port=port)
        if self._store is None:
            return bootstrap, round_store
        return bootstrap, PrefixStore(keys.AGENT_PREFIX, self._store)

    def release(self) -> None:
        """Stop hosting (or drop the connection to) the current round's store."""
        self._store = None
