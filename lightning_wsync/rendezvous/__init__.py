"""The ``wsync`` torchrun rendezvous backend: a trainer job and rollout jobs on one store.

Launch the two jobs with the same endpoint and id; ``role`` picks the elastic group::

    torchrun --nnodes=1 --nproc-per-node=2 --rdzv-backend=wsync \\
        --rdzv-endpoint=HOST:29400 --rdzv-id=exp1 --rdzv-conf role=trainer train.py
    torchrun --nnodes=1:3 --nproc-per-node=2 --rdzv-backend=wsync \\
        --rdzv-endpoint=HOST:29400 --rdzv-id=exp1 --rdzv-conf role=rollout rollout.py

Each role is its own stock c10d dynamic rendezvous (inner run id
``<rdzv-id>.<role>.l<launch>``), so a rollout worker that dies, or a rollout node that
joins, restarts rollout workers at most, never trainers. Both share the TCPStore at
the endpoint (the control plane), hosted by the trainer's agent unless ``is_host``
says otherwise. Each round, the rank-0 agent of each role also hosts a fresh store
that its workers reach at ``MASTER_ADDR:MASTER_PORT`` (torch's default agent-store
sharing), so ``init_process_group("gloo")`` works in both jobs, across restarts and
scale-up.

Every worker of both jobs gets in its environment:

=================  ==========================================================
``WSYNC_STORE``    ``host:port`` of the shared control-plane TCPStore
``WSYNC_JOB``      the ``--rdzv-id``
``WSYNC_ROLE``     ``trainer`` or ``rollout``
=================  ==========================================================

``--rdzv-conf`` keys (timeouts in whole seconds; anything else is an error):

==========================  =========  ===============================================
key                         default    meaning
==========================  =========  ===============================================
``role``                    required   ``trainer`` or ``rollout``
``is_host``                 see right  host the store at the endpoint: a trainer agent on
                                       the endpoint's machine does (and joins as a
                                       client if the port is taken), others never do;
                                       ``true``/``false`` forces either way
``last_call_timeout``       1          wait for more nodes once ``min`` have joined
                                       (stock c10d: 30, which delays ``--nnodes=1:K``
                                       by half a minute; later nodes join by a
                                       re-rendezvous anyway)
``join_timeout``            600        a rendezvous round, including waiting for the
                                       store host to come up
``close_timeout``           30         closing the rendezvous at shutdown
``heartbeat_timeout``       5          one keep-alive heartbeat
``keep_alive_interval``     5          seconds between an agent's heartbeats
``keep_alive_max_attempt``  3          missed heartbeats before an agent counts as dead
``read_timeout``            60         one store operation
``linger_timeout``          10         how long the store's host keeps it up after its
                                       own job finished while other agents still use it
                                       (rollout agents that end cleanly release it at
                                       once; 0 disables)
==========================  =========  ===============================================

The job that hosts the store ends it when it ends, after lingering up to
``linger_timeout`` for the other job's agents. A rollout job outliving its trainer
then finishes cleanly (no new members can join; its workers run to completion). For
jobs that must outlive each other, run a standalone store and make both clients::

    lightning-wsync store --host 0.0.0.0 --port 29400
    torchrun ... --rdzv-conf role=trainer,is_host=false train.py

Relaunching a role with the same ``--rdzv-id`` against a store that still runs moves
that role to a fresh launch number (shutdown closes a c10d rendezvous for good).

This module is imported by torch while it registers rendezvous backends; it stays
free of heavy imports, and the handler is loaded only when torchrun asks for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_wsync.rendezvous._config import (
    ENV_JOB,
    ENV_ROLE,
    ENV_STORE,
    VALID_ROLES,
    WsyncRendezvousConfig,
    parse_rdzv_conf,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed.elastic.rendezvous.api import (
        RendezvousHandler,
        RendezvousParameters,
    )

__all__ = [
    "ENV_JOB",
    "ENV_ROLE",
    "ENV_STORE",
    "VALID_ROLES",
    "WsyncRendezvousConfig",
    "create_handler",
    "entry_point",
    "parse_rdzv_conf",
]


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the ``wsync`` rendezvous handler for torchrun's parameters.

    Raises:
        ValueError: a bad ``--rdzv-conf``.
        RendezvousConnectionError: the shared store cannot be hosted or reached.
    """
    from lightning_wsync.rendezvous._handler import create_handler as _create

    return _create(params)


def entry_point() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: returns the handler creator."""
    return create_handler
