"""``WsyncRendezvousHandler``: one stock dynamic c10d rendezvous per role, one store.

The handler wraps torch's ``DynamicRendezvousHandler`` (built with the c10d backend
and ``create_handler``) under a role-scoped inner run id, so the trainer and the
rollout jobs form separate elastic groups on the shared store, and adds what
torch 2.13 lacks for that setup:

* **launches**: shutdown marks a rendezvous closed in the store for good, so the inner
  run id carries a launch number that the next launch with the same ``--rdzv-id`` bumps.
* **a fresh bootstrap store every round** (:mod:`._round`), published by rank 0, for
  the workers and for torchrun's agent.
* **the host lingers**: an agent hosting the shared store keeps it up after its job
  ends while other agents still use it (bounded by ``linger_timeout``), so rollout
  workers see the sender's close signal rather than a vanished store.
* **store loss is the end of membership, not a crash**: once the shared store's host
  has gone, no node can arrive; the running workers carry on and the agent ends
  cleanly when they finish, so a rollout job outlives its trainer's store.

Longer than 300 lines: one ``RendezvousHandler`` implementation, each of torch's abstract
methods beside what it adds for a role-scoped, relaunchable, lingering rendezvous.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

# torch.distributed re-exports these without marking them public; mypy --strict wants
# them from where the stubs define them.
from torch._C._distributed_c10d import Store
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    create_handler as create_dynamic_handler,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from typing_extensions import override

from lightning_wsync._control import keys
from lightning_wsync._control.signing import resolve_secret
from lightning_wsync.rendezvous._config import (
    ENV_JOB,
    ENV_ROLE,
    ENV_STORE,
    WsyncRendezvousConfig,
    parse_rdzv_conf,
)
from lightning_wsync.rendezvous._round import RoundStore
from lightning_wsync.rendezvous._store import (
    GuardedC10dBackend,
    StoreHealth,
    open_store,
)

__all__ = ["BACKEND_NAME", "DEFAULT_PORT", "WsyncRendezvousHandler", "create_handler"]

log = logging.getLogger(__name__)

BACKEND_NAME = "wsync"
DEFAULT_PORT = 29400

_LINGER_POLL_S = 0.1


class WsyncRendezvousHandler(RendezvousHandler):
    """The ``wsync`` torchrun rendezvous backend for one role of one job.

    Construct it with :func:`create_handler`; torchrun does so through the
    ``torchrun.handlers`` entry point.

    Args:
        job: the user's ``--rdzv-id``, shared by the trainer and rollout jobs.
        config: the parsed ``--rdzv-conf``.
        store: the shared control-plane store at the endpoint.
        health: liveness of that store.
        hosting: whether this process hosts that store.
        min_nodes: ``--nnodes`` lower bound.
        max_nodes: ``--nnodes`` upper bound.
        local_addr: ``--local-addr``, this node's address in the rendezvous.
    """

    def __init__(
        self,
        *,
        job: str,
        config: WsyncRendezvousConfig,
        store: Store,
        health: StoreHealth,
        hosting: bool,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
    ) -> None:
        _check_job(job)
        self._job = job
        self._config = config
        self._store = store
        self._health = health
        self._hosting = hosting
        self._min_nodes = min_nodes
        self._max_nodes = max_nodes
        self._local_addr = local_addr
        self._launch_key = keys.rdzv_launch(job, config.role)
        self._launch = int(store.add(self._launch_key, 0))
        # Agents of this job (both roles) using the store, for the host's linger.
        self._agents_key = keys.rdzv_agents(job)
        store.add(self._agents_key, 1)
        self._counted = True
        self._inner = self._create_inner(self._launch)
        self._joined = False
        self._retired = False
        self._round = RoundStore(timedelta(seconds=config.read_timeout_s))
        self._saved_env: dict[str, str | None] | None = None

    @property
    def inner_run_id(self) -> str:
        """The run id of the wrapped c10d rendezvous: ``<job>.<role>.l<launch>``."""
        return self._inner.get_run_id()

    @override
    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    @override
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    @override
    def next_rendezvous(self) -> RendezvousInfo:
        if self._store_lost():
            raise RendezvousClosedError(self._lost_message())
        self._export_env()
        deadline = time.monotonic() + self._config.join_timeout_s
        while True:
            try:
                info = self._inner.next_rendezvous()
                break
            except RendezvousClosedError:
                # A closed rendezvous we never joined was left by an earlier launch with
                # this --rdzv-id; one we did join was closed by our own job ending.
                if self._joined or time.monotonic() >= deadline:
                    raise
                self._advance_launch()
            except RendezvousConnectionError as exc:
                if self._store_lost():
                    raise RendezvousClosedError(self._lost_message()) from exc
                raise
        self._joined = True
        bootstrap, agent_store = self._round.next_round(
            info, self._inner.use_agent_store
        )
        log.info(
            "wsync rendezvous %r: role %s joined %s as node %d of %d",
            self._job,
            self._config.role,
            self.inner_run_id,
            info.rank,
            info.world_size,
        )
        return RendezvousInfo(agent_store, info.rank, info.world_size, bootstrap)

    @override
    def is_closed(self) -> bool:
        if self._store_lost():
            return True
        try:
            return self._inner.is_closed()
        except RendezvousConnectionError:
            if self._store_lost():
                return True
            raise

    @override
    def set_closed(self) -> None:
        if self._store_lost():
            return
        self._inner.set_closed()

    @override
    def num_nodes_waiting(self) -> int:
        # torchrun polls this between worker health checks. Once the store host is
        # gone no node can arrive: report none, and the running workers carry on.
        if self._store_lost():
            return 0
        try:
            return self._inner.num_nodes_waiting()
        except RendezvousConnectionError:
            if self._store_lost():
                return 0
            raise

    @override
    def get_run_id(self) -> str:
        return self._job

    @override
    def shutdown(self) -> bool:
        try:
            self._health.listening()
            if self._store_lost():
                log.info(
                    "wsync rendezvous %r: %s went with its store; nothing to close",
                    self._job,
                    self.inner_run_id,
                )
                return True
            closed = self._inner.shutdown()
            if self._counted:
                self._counted = False
                self._store.add(self._agents_key, -1)
            if self._hosting:
                self._linger()
            return closed
        finally:
            self._round.release()  # this node's workers are gone; stop serving them
            self._restore_env()

    def _linger(self) -> None:
        """Keep hosting the store while other agents still use it, up to the linger timeout.

        Ending the host ends the store: a rollout worker that has not yet seen the
        sender's close signal would find the store gone instead. Agents that end
        cleanly deregister at shutdown; one that was killed never does, which costs
        this wait its full bound.
        """
        deadline = time.monotonic() + self._config.linger_timeout_s
        others = int(self._store.add(self._agents_key, 0))
        if others <= 0 or self._config.linger_timeout_s == 0:
            return
        log.info(
            "wsync rendezvous %r: keeping the store at %s up for at most %d s while %d other "
            "agent(s) finish with it (--rdzv-conf linger_timeout)",
            self._job,
            self._health.address,
            self._config.linger_timeout_s,
            others,
        )
        while others > 0 and time.monotonic() < deadline:
            time.sleep(_LINGER_POLL_S)
            others = int(self._store.add(self._agents_key, 0))
        if others > 0:
            log.warning(
                "wsync rendezvous %r: closing the store at %s although %d agent(s) still use "
                "it (linger_timeout=%d s ran out); they will find it gone",
                self._job,
                self._health.address,
                others,
                self._config.linger_timeout_s,
            )

    def _store_lost(self) -> bool:
        """Whether the shared store is gone; the first time, retire the inner handler.

        Retiring stops its keep-alive thread, which would otherwise log a failed
        heartbeat every ``keep_alive_interval`` for as long as the workers run. Only
        called from torchrun's agent thread (stopping joins the heartbeat thread).
        """
        if not self._health.lost:
            return False
        if not self._retired:
            self._retired = True
            # Closing fails without a store (torch logs one warning); what matters is
            # that shutdown() stops the heartbeats first.
            self._inner.shutdown()
        return True

    def _lost_message(self) -> str:
        return (
            f"wsync rendezvous {self._job!r} ({self._config.role}): "
            f"{self._health.lost_message()}"
        )

    def _create_inner(self, launch: int) -> DynamicRendezvousHandler:
        run_id = f"{self._job}.{self._config.role}.l{launch}"
        cfg = self._config
        params = RendezvousParameters(
            backend=BACKEND_NAME,
            endpoint=self._health.address,
            run_id=run_id,
            min_nodes=self._min_nodes,
            max_nodes=self._max_nodes,
            local_addr=self._local_addr,
            join_timeout=cfg.join_timeout_s,
            last_call_timeout=cfg.last_call_timeout_s,
            close_timeout=cfg.close_timeout_s,
            heartbeat_timeout=cfg.heartbeat_timeout_s,
            keep_alive_interval=cfg.keep_alive_interval_s,
            keep_alive_max_attempt=cfg.keep_alive_max_attempt,
        )
        backend = GuardedC10dBackend(self._store, run_id, self._health, _secret())
        return create_dynamic_handler(self._store, backend, params)

    def _advance_launch(self) -> None:
        closed = self.inner_run_id
        current = self._store.compare_set(
            self._launch_key, str(self._launch), str(self._launch + 1)
        )
        self._launch = int(current)
        self._inner = self._create_inner(self._launch)
        log.info(
            "wsync rendezvous %r: %s was closed by an earlier launch; using %s",
            self._job,
            closed,
            self.inner_run_id,
        )

    def _export_env(self) -> None:
        """Point this agent's future workers at the shared store (they inherit os.environ)."""
        values = {
            ENV_STORE: self._health.address,
            ENV_JOB: self._job,
            ENV_ROLE: self._config.role,
        }
        if self._saved_env is None:
            self._saved_env = {name: os.environ.get(name) for name in values}
            for name, value in values.items():
                previous = os.environ.get(name)
                if previous is not None and previous != value:
                    log.warning(
                        "wsync rendezvous: overriding %s=%r with %r from the rendezvous "
                        "(--rdzv-endpoint, --rdzv-id, --rdzv-conf role)",
                        name,
                        previous,
                        value,
                    )
        os.environ.update(values)

    def _restore_env(self) -> None:
        if self._saved_env is None:
            return
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env = None


def _secret() -> bytes | None:
    """The job's shared secret (``WSYNC_SECRET``): it signs the rendezvous state."""
    return resolve_secret(None, "wsync rendezvous")  # set but empty: a ValueError, not silently unsigned


def _check_job(job: str) -> None:
    if not job or "/" in job:
        raise ValueError(
            f"wsync rendezvous: --rdzv-id {job!r} must be non-empty and contain no '/' "
            "(it names the job's keys on the shared store). Fix: e.g. --rdzv-id=exp1."
        )


def create_handler(params: RendezvousParameters) -> WsyncRendezvousHandler:
    """Build the ``wsync`` handler from torchrun's parameters.

    Raises:
        ValueError: a bad ``--rdzv-conf`` (see :func:`parse_rdzv_conf`).
        RendezvousConnectionError: the shared store cannot be hosted or reached.
    """
    config = parse_rdzv_conf(params.config)
    _check_job(params.run_id)
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    health = StoreHealth(host, port)
    store, hosting = open_store(health, config)
    log.info(
        "wsync rendezvous %r: role=%s store=%s (%s) nnodes=%d:%d",
        params.run_id,
        config.role,
        health.address,
        "hosted here" if hosting else "client",
        params.min_nodes,
        params.max_nodes,
    )
    return WsyncRendezvousHandler(
        job=params.run_id,
        config=config,
        store=store,
        health=health,
        hosting=hosting,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
    )
