"""Facts about this host and its processes: the host identity behind the same-host
decision, the address other hosts reach this process at, PID liveness and PID namespaces,
the default receiver name."""

from __future__ import annotations

import os
import socket

from lightning_wsync._control.keys import ENV_ADDR, ENV_HOST_ID, ENV_ROLE
from lightning_wsync._control.store import parse_address


def host_id() -> str:
    """Identity of this host for the same-host decision: ``$WSYNC_HOST_ID`` wins, else
    hostname plus kernel boot id (network namespaces share both, hence the override)."""
    explicit = os.environ.get(ENV_HOST_ID)
    if explicit:
        return explicit
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def default_receiver_name() -> str:
    """``<role>-<rank>@<host>`` under torchrun, else ``<role>@<host>:<pid>``."""
    role = os.environ.get(ENV_ROLE, "receiver")
    rank = os.environ.get("RANK")
    if rank is not None:
        return f"{role}-{rank}@{socket.gethostname()}"
    return f"{role}@{socket.gethostname()}:{os.getpid()}"


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a running (not zombie) process on this host."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_namespace() -> int:
    """This process's PID namespace (0 when unknown): a PID means the same process only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def local_address(store_address: str | None) -> str:
    """The address other hosts reach this process at: ``$WSYNC_ADDR``, else the
    interface that routes to the store, else 127.0.0.1."""
    explicit = os.environ.get(ENV_ADDR)
    if explicit:
        return explicit
    if store_address is not None:
        host, port = parse_address(store_address, "store")
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, port or 1))  # UDP connect sends nothing; it picks the route
                return str(probe.getsockname()[0])
        except OSError:
            pass
    return "127.0.0.1"
