"""Simulated hosts on one machine: network namespaces on a bridge, links shaped with tc.

Everything lives inside an isolated session started by :func:`isolated_argv`:
``unshare --net --mount --pid --fork --kill-child --mount-proc``. In it, ``/run`` (where
``ip netns`` keeps its handles) and ``/dev/shm`` are private tmpfs mounts, the bridge
lives in the session's own network namespace (the "switch"), and the session's first
process is PID 1 of its own PID namespace: when it exits, or the ``unshare`` outside is
killed, the kernel kills every process of the session and the namespaces, bridge,
segments and mounts disappear with it. Nothing can outlive the session.

::

    # outside (any process):
    subprocess.run(isolated_argv([sys.executable, "scenario.py"]), timeout=300)
    # inside scenario.py:
    prepare_session()
    with SimHosts(3) as hosts:
        hosts.shape(1, "700mbit")
        proc = subprocess.Popen(argv, preexec_fn=hosts.preexec(1), env=hosts.env(1))

Host ``i`` has the address ``10.77.0.<i+1>`` on its ``eth0`` and ``WSYNC_HOST_ID=simh<i>``
in :meth:`SimHosts.env` (namespaces share ``/dev/shm``, hostname and boot id, so the
same-host decision needs the override). Shaping models a NIC: ``tbf`` on the host's
``eth0`` (what it sends) and on its switch port (what it receives); tbf delivers ~96%
of the configured rate.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from types import TracebackType

from typing_extensions import Self

from lightning_wsync._control.keys import ENV_ADDR, ENV_HOST_ID

ENV_SESSION = "WSYNC_SIMNET_SESSION"
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_NETNS_DIR = "/run/netns"
_TOOLS = ("ip", "tc", "unshare", "mount")


def missing_requirements() -> str | None:
    """Why simulated hosts cannot be built here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, bridges, tc)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return (
            f"simulated hosts need {', '.join(missing)} on PATH (iproute2, util-linux)"
        )
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "true"],
        capture_output=True, timeout=30, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        return f"unshare --net --mount --pid fails here: {probe.stderr.decode(errors='replace').strip()[:200]}"
    return None


def isolated_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped to run as PID 1 of a fresh network, mount and PID namespace."""
    return [
        "unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
        "--propagation", "private", "env", f"{ENV_SESSION}=1", *argv,
    ]  # fmt: skip


def in_session() -> bool:
    """Whether this process runs inside a session started through :func:`isolated_argv`."""
    return os.environ.get(ENV_SESSION) == "1" and os.getpid() == 1


def prepare_session() -> None:
    """Private ``/run`` and ``/dev/shm`` for the session; call once, first, as its PID 1."""
    if not in_session():
        raise RuntimeError(
            "prepare_session() outside an isolated session; start it through isolated_argv()"
        )
    for target in ("/run", "/dev/shm"):
        _run(["mount", "-t", "tmpfs", "-o", "mode=1777", "wsync-sim", target])
    os.makedirs(_NETNS_DIR, exist_ok=True)
    _run(["ip", "link", "set", "lo", "up"])


def _run(argv: Sequence[str]) -> str:
    done = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=30, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)!r} failed (rc={done.returncode}): {done.stderr.strip()[:300]}"
        )
    return done.stdout


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def assume_host(host_id: str) -> None:
    """Give this process (and what it starts later) the host identity ``host_id``, as :meth:`SimHosts.env` does."""
    os.environ[ENV_HOST_ID] = host_id


def enter_netns(path: str) -> None:
    """Move the calling thread (and what it starts later) into the network namespace at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc().setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path!r}): {os.strerror(err)}")
    finally:
        os.close(fd)


class SimHosts:
    """``n`` simulated hosts ``simh0 .. simh<n-1>`` on one bridge; removed on exit."""

    def __init__(self, n: int, *, subnet: str = "10.77.0") -> None:
        if not 1 <= n <= 250:
            raise ValueError(f"SimHosts: n={n!r} must be in 1..250")
        self.n = n
        self._subnet = subnet
        self._up = False

    def name(self, i: int) -> str:
        return f"simh{i}"

    def address(self, i: int) -> str:
        return f"{self._subnet}.{i + 1}"

    def netns_path(self, i: int) -> str:
        return os.path.join(_NETNS_DIR, self.name(i))

    def env(self, i: int, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment of a process on host ``i``: its host identity and address."""
        env = dict(os.environ if base is None else base)
        env[ENV_HOST_ID] = self.name(i)
        env[ENV_ADDR] = self.address(i)
        return env

    def up(self) -> None:
        if not in_session():
            raise RuntimeError(
                "SimHosts outside an isolated session; start it through isolated_argv()"
            )
        _run(["ip", "link", "add", "wsbr0", "type", "bridge"])
        _run(["ip", "link", "set", "wsbr0", "up"])
        for i in range(self.n):
            ns = self.name(i)
            _run(["ip", "netns", "add", ns])
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    "eth0",
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    f"p{i}",
                ]
            )
            _run(["ip", "link", "set", f"p{i}", "master", "wsbr0", "up"])
            _run(
                ["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0"]
            )
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        self._up = True

    def shape(self, i: int, rate: str | None, *, burst: str = "1mb") -> None:
        """Shape host ``i``'s link both ways to ``rate`` (tc syntax, e.g. ``"700mbit"``); None: unshaped."""
        for prefix, dev in ((["-n", self.name(i)], "eth0"), ([], f"p{i}")):
            subprocess.run(
                ["tc", *prefix, "qdisc", "del", "dev", dev, "root"],
                capture_output=True,
                check=False,
            )
            if rate is not None:
                _run(["tc", *prefix, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                      "burst", burst, "latency", "10ms"])  # fmt: skip

    def counters(self, i: int) -> tuple[int, int]:
        """(tx_bytes, rx_bytes) of host ``i``'s ``eth0``, read inside its namespace."""
        link = json.loads(
            _run(["ip", "-n", self.name(i), "-s", "-j", "link", "show", "dev", "eth0"])
        )[0]
        stats = link["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def enter(self, i: int) -> None:
        """Move the calling thread into host ``i`` (processes it starts afterwards live there)."""
        enter_netns(self.netns_path(i))

    def preexec(self, i: int) -> Callable[[], None]:
        """A ``preexec_fn`` that starts the child on host ``i`` and kills it with its parent."""
        path = self.netns_path(i)

        def start_on_host() -> None:
            _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            enter_netns(path)

        return start_on_host

    def popen(
        self,
        i: int,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        **kwargs: object,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on host ``i`` with :meth:`env`."""
        return subprocess.Popen(  # type: ignore[call-overload, no-any-return]  # kwargs pass through
            list(argv),
            env=self.env(i, env),
            preexec_fn=self.preexec(i),  # noqa: PLW1509 - the child runs only prctl and setns
            **kwargs,
        )

    def pids(self, i: int) -> list[int]:
        out = subprocess.run(
            ["ip", "netns", "pids", self.name(i)],
            capture_output=True,
            text=True,
            check=False,
        )
        return [int(p) for p in out.stdout.split()]

    def down(self) -> None:
        """Kill every process on every host, then remove the namespaces and the bridge."""
        if not self._up:
            return
        self._up = False
        for i in range(self.n):
            for pid in self.pids(i):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(
                ["ip", "netns", "del", self.name(i)], capture_output=True, check=False
            )
        subprocess.run(["ip", "link", "del", "wsbr0"], capture_output=True, check=False)

    def __enter__(self) -> Self:
        self.up()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()
