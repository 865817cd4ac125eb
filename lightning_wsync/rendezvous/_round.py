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

__all__ = ["RoundStore"]

# Written by each round's rank 0 in the inner handler's round-scoped store.
_BOOTSTRAP_KEY = "WSYNC_BOOTSTRAP"
# Keys of torchrun's agent on the round's store, apart from the workers' "default_pg/".
_AGENT_KEY_PREFIX = "wsync.agent"


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
                server = TCPStore(
                    addr,
                    0,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=self._timeout,
                )
                self._store, port = server, server.port
            round_store.set(_BOOTSTRAP_KEY, json.dumps({"addr": addr, "port": port}))
            # Unblocks a joining node whose inner handler waits for the stock keys.
            round_store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, addr)
            round_store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(port))
        else:
            published = json.loads(round_store.get(_BOOTSTRAP_KEY))
            addr, port = str(published["addr"]), int(published["port"])
            if use_agent_store:
                self._store = TCPStore(
                    addr, port, is_master=False, timeout=self._timeout
                )
        bootstrap = RendezvousStoreInfo(master_addr=addr, master_port=port)
        if self._store is None:
            return bootstrap, round_store
        return bootstrap, PrefixStore(_AGENT_KEY_PREFIX, self._store)

    def release(self) -> None:
        """Stop hosting (or drop the connection to) the current round's store."""
        self._store = None
