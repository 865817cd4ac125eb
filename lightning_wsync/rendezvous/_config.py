"""``--rdzv-conf`` for the ``wsync`` backend: one typed config, parsed in one place.

Pure Python on purpose: torch imports this package while it registers rendezvous
backends, so nothing here may import torch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

# Exported to every worker of both jobs (workers inherit the agent's environment).
from lightning_wsync._control.keys import ENV_JOB, ENV_ROLE, ENV_SECRET, ENV_STORE

__all__ = [
    "ENV_JOB",
    "ENV_ROLE",
    "ENV_SECRET",
    "ENV_STORE",
    "VALID_ROLES",
    "Role",
    "WsyncRendezvousConfig",
    "parse_rdzv_conf",
]

Role = Literal["trainer", "rollout"]
VALID_ROLES: tuple[Role, ...] = get_args(Role)


# torchrun always injects this legacy key (its --rdzv-timeout, default 900); the
# c10d backend ignores it, and so do we.
_TORCHRUN_LEGACY_TIMEOUT_KEY = "timeout"
_TORCHRUN_DEFAULT_TIMEOUT = 900

log = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class WsyncRendezvousConfig:
    """What ``--rdzv-conf`` can set for ``--rdzv-backend=wsync``.

    Conf keys keep the stock c10d names (``last_call_timeout=2``); fields carry the
    unit (``last_call_timeout_s``). Timeouts are whole seconds, as in c10d.

    Attributes:
        role: which elastic group this job forms: ``"trainer"`` or ``"rollout"``.
        is_host: whether this agent hosts the shared TCPStore at the endpoint.
            ``None`` (default) means: the trainer tries to host and joins as a client
            if the port is already taken (e.g. by ``lightning-wsync store``); a
            rollout job never hosts. ``True`` hosts or fails; ``False`` never hosts.
        join_timeout_s: how long a rendezvous round may take, including waiting for
            the store host to come up.
        last_call_timeout_s: extra wait for more nodes once ``min_nodes`` have joined.
            Stock c10d waits 30 s; wsync waits 1 s so that ``--nnodes=1:K`` starts at
            once and later nodes join by re-rendezvous.
        close_timeout_s: how long closing the rendezvous at shutdown may take.
        heartbeat_timeout_s: how long one keep-alive heartbeat may take.
        keep_alive_interval_s: seconds between keep-alive heartbeats of an agent.
        keep_alive_max_attempt: missed heartbeats after which an agent is dead.
        read_timeout_s: timeout of one store operation.
        linger_timeout_s: how long an agent that hosts the store keeps it up after its
            own job finished, while agents of other jobs (or other nodes of its own)
            still use it, so that they see the close and end cleanly; 0 disables.
    """

    role: Role
    is_host: bool | None = None
    join_timeout_s: int = 600
    last_call_timeout_s: int = 1
    close_timeout_s: int = 30
    heartbeat_timeout_s: int = 5
    keep_alive_interval_s: int = 5
    keep_alive_max_attempt: int = 3
    read_timeout_s: int = 60
    linger_timeout_s: int = 10

    def __post_init__(self) -> None:
        if self.role not in VALID_ROLES:
            raise ValueError(
                f"wsync rendezvous: role={self.role!r} is not a valid role; valid roles: "
                f"{', '.join(VALID_ROLES)}. Fix: pass --rdzv-conf role=trainer or role=rollout."
            )
        for key, field_name in _INT_KEYS.items():
            value = getattr(self, field_name)
            lowest = _LOWEST.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ValueError(
                    f"wsync rendezvous: {field_name}={value!r} must be a whole number >= {lowest}. "
                    f"Fix: pass --rdzv-conf {key}=<int>."
                )

    @property
    def hosts_by_default(self) -> bool:
        """Whether this agent tries to host the store when ``is_host`` is unset."""
        return self.role == "trainer"


# conf key -> dataclass field, for the whole-seconds / count options.
_INT_KEYS: dict[str, str] = {
    "join_timeout": "join_timeout_s",
    "last_call_timeout": "last_call_timeout_s",
    "close_timeout": "close_timeout_s",
    "heartbeat_timeout": "heartbeat_timeout_s",
    "keep_alive_interval": "keep_alive_interval_s",
    "keep_alive_max_attempt": "keep_alive_max_attempt",
    "read_timeout": "read_timeout_s",
    "linger_timeout": "linger_timeout_s",
}
# Keys where 0 means "off"; the others must be at least 1.
_LOWEST: dict[str, int] = {"linger_timeout": 0}
_VALID_KEYS: tuple[str, ...] = ("role", "is_host", *_INT_KEYS)
_TRUE = frozenset({"1", "true", "t", "yes", "y"})
_FALSE = frozenset({"0", "false", "f", "no", "n"})


def parse_rdzv_conf(conf: Mapping[str, object]) -> WsyncRendezvousConfig:
    """Parse torchrun's ``--rdzv-conf`` mapping into a :class:`WsyncRendezvousConfig`.

    Values arrive as strings (torchrun adds the integer ``timeout``, which is ignored).

    Raises:
        ValueError: one line naming the key, the value and the fix, for an unknown key,
            a missing or unknown role, or a value of the wrong kind.

    Example:
        >>> parse_rdzv_conf({"role": "rollout", "last_call_timeout": "2"}).last_call_timeout_s
        2
    """
    valid_keys = ", ".join(_VALID_KEYS)
    unknown = [
        key
        for key in conf
        if key not in _VALID_KEYS and key != _TORCHRUN_LEGACY_TIMEOUT_KEY
    ]
    if unknown:
        key = unknown[0]
        raise ValueError(
            f"wsync rendezvous: unknown --rdzv-conf key {key!r} (value {conf[key]!r}); valid keys: "
            f"{valid_keys}. Fix: remove it or correct the spelling."
        )
    if "role" not in conf:
        raise ValueError(
            f"wsync rendezvous: --rdzv-conf has no 'role' key (got {dict(conf)!r}); valid roles: "
            f"{', '.join(VALID_ROLES)}. Fix: add --rdzv-conf role=trainer or role=rollout."
        )
    role = str(conf["role"]).strip().lower()
    if role not in VALID_ROLES:
        raise ValueError(
            f"wsync rendezvous: --rdzv-conf key 'role' has invalid value {conf['role']!r}; valid "
            f"roles: {', '.join(VALID_ROLES)}. Fix: --rdzv-conf role=trainer or role=rollout."
        )
    ints: dict[str, int] = {}
    for key, field_name in _INT_KEYS.items():
        if key in conf:
            ints[field_name] = _parse_whole_number(key, conf[key])
    is_host = _parse_bool("is_host", conf["is_host"]) if "is_host" in conf else None
    legacy_timeout = conf.get(_TORCHRUN_LEGACY_TIMEOUT_KEY, _TORCHRUN_DEFAULT_TIMEOUT)
    if str(legacy_timeout).strip() != str(_TORCHRUN_DEFAULT_TIMEOUT):
        log.warning(
            "wsync rendezvous ignores timeout=%r (torchrun's legacy --rdzv-timeout); "
            "set --rdzv-conf join_timeout=<seconds> instead",
            legacy_timeout,
        )
    return WsyncRendezvousConfig(
        role=VALID_ROLES[VALID_ROLES.index(role)],
        is_host=is_host,
        **ints,
    )


def _parse_whole_number(key: str, value: object) -> int:
    lowest = _LOWEST.get(key, 1)
    try:
        parsed = int(str(value).strip())
    except ValueError:
        parsed = lowest - 1
    if parsed < lowest:
        if key == "keep_alive_max_attempt":
            expected = "a positive integer (a count)"
        elif lowest == 0:
            expected = "a non-negative integer (whole seconds; 0 disables)"
        else:
            expected = "a positive integer (whole seconds)"
        raise ValueError(
            f"wsync rendezvous: --rdzv-conf key {key!r} has invalid value {value!r}; expected "
            f"{expected}. Fix: e.g. --rdzv-conf {key}=5."
        )
    return parsed


def _parse_bool(key: str, value: object) -> bool:
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(
        f"wsync rendezvous: --rdzv-conf key {key!r} has invalid value {value!r}; expected true or "
        f"false. Fix: --rdzv-conf {key}=true or {key}=false."
    )
