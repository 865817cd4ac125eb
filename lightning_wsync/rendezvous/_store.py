"""The shared control-plane TCPStore as one torchrun agent sees it.

Hosting or joining the store at the rendezvous endpoint, noticing that its host has
gone, and the stock c10d rendezvous backend guarded so that a vanished store fails
fast and quietly. Every ``TCPStore`` operation against a dead server makes torch's C++
layer print a multi-line stack dump, so liveness is checked first with a plain TCP
connect: a refused connection means nobody listens at the endpoint any more.

Longer than 300 lines: hosting, joining and watching the shared store in one place, with
the guarded c10d backend that must fail fast when the store's host is gone.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import threading
import time
from typing import Any

# torch.distributed re-exports these without marking them public; mypy --strict wants
# them from where the stubs define them.
from torch._C._distributed_c10d import Store, TCPStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    C10dRendezvousBackend,
)
from typing_extensions import override

from lightning_wsync._control import keys
from lightning_wsync._control.signing import derive_key
from lightning_wsync._control.store import tcp_store
from lightning_wsync.rendezvous._config import WsyncRendezvousConfig

__all__ = [
    "GuardedC10dBackend",
    "StoreHealth",
    "format_address",
    "names_this_machine",
    "open_store",
]

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 2.0
_SIGNED_STATE = b"wsync-signed-state-v1\0"  # then 32 bytes of HMAC-SHA256, then the pickle
_LISTEN_POLL_S = 0.2


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 literal."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class StoreHealth:
    """Whether the store at the rendezvous endpoint still listens.

    Once a probe is refused the store is *lost* for good: the process that hosted it
    has ended, and everything that needs it should stop asking.

    Args:
        host: the endpoint host.
        port: the endpoint port.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._lost = threading.Event()

    @property
    def address(self) -> str:
        """The endpoint as ``host:port``."""
        return format_address(self.host, self.port)

    @property
    def lost(self) -> bool:
        """Whether a probe found nobody listening at the endpoint."""
        return self._lost.is_set()

    def listening(self) -> bool:
        """Probe the endpoint; a refused connection marks the store lost.

        Returns:
            ``False`` when the store is lost, ``True`` otherwise (an inconclusive probe,
            e.g. a timeout on a busy network, counts as listening).
        """
        if self._lost.is_set():
            return False
        try:
            with socket.create_connection(
                (self.host, self.port), timeout=_PROBE_TIMEOUT_S
            ):
                return True
        except ConnectionRefusedError:
            self._mark_lost()
            return False
        except OSError:
            return True

    def check(self) -> None:
        """Raise unless the store still listens.

        Raises:
            RendezvousConnectionError: the store is lost.
        """
        if not self.listening():
            raise RendezvousConnectionError(self.lost_message())

    def lost_message(self) -> str:
        """One line explaining what a lost store means and what to do."""
        return (
            f"the control-plane store at {self.address} is gone: the process that hosted it "
            "(by default the trainer's torchrun agent) has ended. No node can join this job "
            "any more; its running workers carry on until they finish. To let jobs outlive "
            "each other, run `lightning-wsync store` and pass --rdzv-conf is_host=false to "
            "both jobs."
        )

    def wait_listening(self, timeout_s: float) -> None:
        """Wait, quietly, until something listens at the endpoint.

        ``TCPStore``'s own connect retries print C++ warnings on every attempt; a rollout
        job started before its trainer would flood its log with them.

        Raises:
            RendezvousConnectionError: nothing listened within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        announced = False
        while True:
            try:
                with socket.create_connection(
                    (self.host, self.port), timeout=_PROBE_TIMEOUT_S
                ):
                    return
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise RendezvousConnectionError(
                        f"wsync rendezvous: no store listens at {self.address} after "
                        f"{timeout_s:.0f} s (last error: {exc}). Start the trainer job (it "
                        "hosts the store) or `lightning-wsync store`, or raise "
                        "--rdzv-conf join_timeout."
                    ) from exc
            if not announced:
                log.info(
                    "waiting up to %.0f s for the control-plane store at %s",
                    timeout_s,
                    self.address,
                )
                announced = True
            time.sleep(_LISTEN_POLL_S)

    def _mark_lost(self) -> None:
        if not self._lost.is_set():
            self._lost.set()
            log.warning("wsync rendezvous: %s", self.lost_message())


def open_store(
    health: StoreHealth, config: WsyncRendezvousConfig
) -> tuple[TCPStore, bool]:
    """Host the shared store at the endpoint, or connect to it.

    With ``is_host`` unset, a trainer agent on the endpoint's machine tries to host and
    becomes a client when the port is taken (a standalone ``lightning-wsync store``, or
    another trainer node on this machine); other agents connect as clients.

    Returns:
        The store and whether this process hosts it.

    Raises:
        RendezvousConnectionError: the store cannot be hosted (``is_host=true`` and the
            port is taken) or reached within ``join_timeout``.
    """
    if config.is_host is not None:
        wants_host = config.is_host
    else:
        # Like stock c10d: only an agent on the endpoint's machine may host, or every
        # trainer node of a multi-node job would serve a store of its own.
        wants_host = config.hosts_by_default and names_this_machine(health.host)
    if wants_host:
        try:
            store = tcp_store(health.host, health.port, serve=True, timeout_s=config.read_timeout_s)
        except (RuntimeError, ValueError) as exc:
            if config.is_host:
                raise RendezvousConnectionError(
                    f"wsync rendezvous: cannot host the store at {health.address} "
                    f"(is_host=true): {exc}. Fix: pass --rdzv-conf is_host=false to join the "
                    "store already listening there, or pick a free --rdzv-endpoint port."
                ) from exc
            log.info(
                "wsync rendezvous: %s is already taken; joining the store there as a client",
                health.address,
            )
        else:
            log.info(
                "wsync rendezvous: hosting the control-plane store at %s",
                health.address,
            )
            return store, True
    health.wait_listening(config.join_timeout_s)
    try:
        store = tcp_store(health.host, health.port, serve=False, timeout_s=config.read_timeout_s)
    except (RuntimeError, ValueError) as exc:
        raise RendezvousConnectionError(
            f"wsync rendezvous: cannot connect to the store at {health.address}: {exc}. "
            "Check --rdzv-endpoint; it must point at the trainer's agent or at "
            "`lightning-wsync store`."
        ) from exc
    return store, False


def names_this_machine(host: str) -> bool:
    """Whether ``host`` resolves to an address of this machine (or network namespace).

    Binding a socket to the address succeeds only where the address is local, which
    also tells simulated hosts (network namespaces sharing a hostname) apart.
    """
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0))
        except OSError:
            continue
        return True
    return False


class GuardedC10dBackend(C10dRendezvousBackend):
    """The stock c10d rendezvous backend, failing fast once the store is lost, and
    signing its state when the job has a shared secret.

    torch's dynamic rendezvous keeps its state on the store as a pickle and unpickles
    whatever it reads there. With ``secret`` every state written carries an HMAC-SHA256
    over the store key and the pickle, and state read back is verified *before* it is
    handed to torch: unsigned or forged state raises ``RendezvousStateError`` and is
    never unpickled.

    Args:
        store: the shared store.
        run_id: the role-scoped inner run id.
        health: liveness of the store, shared with the handler.
        secret: the job's shared secret (``WSYNC_SECRET``), or None to sign nothing.
    """

    def __init__(
        self,
        store: Store,
        run_id: str,
        health: StoreHealth,
        secret: bytes | None = None,
    ) -> None:
        self._health = health
        self._secret = None if secret is None else derive_key(secret, f"rdzv/{run_id}")  # never the raw secret
        self._state_key = keys.rdzv_state(run_id)
        health.check()
        super().__init__(store, run_id)

    @override
    def get_state(self) -> tuple[bytes, Any] | None:
        self._health.check()
        try:
            result = super().get_state()
        except RendezvousConnectionError:
            self._health.listening()
            raise
        return None if result is None else (self._verified(result[0]), result[1])

    @override
    def set_state(
        self, state: bytes, token: Any | None = None
    ) -> tuple[bytes, Any, bool] | None:
        self._health.check()
        if token and not isinstance(token, bytes):
            # torch's shortcut for a token it did not issue, answered with verified state.
            current = self.get_state()
            return None if current is None else (*current, False)
        try:
            result = super().set_state(self._signed(state), token)
        except RendezvousConnectionError:
            self._health.listening()
            raise
        if result is None:
            return None
        new_state, new_token, _ = result
        verified = self._verified(new_state)
        return verified, new_token, verified == state

    def _mac(self, state: bytes) -> bytes:
        assert self._secret is not None
        message = self._state_key.encode() + b"\0" + state
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def _signed(self, state: bytes) -> bytes:
        if self._secret is None:
            return state
        return _SIGNED_STATE + self._mac(state) + state

    def _verified(self, raw: bytes) -> bytes:
        """The pickle inside ``raw``, only if signed with the secret (checked before any unpickling)."""
        signed = raw.startswith(_SIGNED_STATE)
        if self._secret is None:
            if signed:
                raise RendezvousStateError(
                    f"wsync rendezvous: the state at store key {self._state_key!r} is signed, but "
                    "this agent has no secret. Fix: set the job's WSYNC_SECRET for every torchrun "
                    "agent of the job."
                )
            return raw
        head = len(_SIGNED_STATE)
        mac, state = raw[head : head + 32], raw[head + 32 :]
        if not signed or not hmac.compare_digest(mac, self._mac(state)):
            raise RendezvousStateError(
                f"wsync rendezvous: refused the state at store key {self._state_key!r}: it is "
                f"{'signed with a different secret' if signed else 'not signed'} (WSYNC_SECRET "
                "is set here). torch keeps this state as a pickle, so it was not unpickled: "
                "someone with access to the store, or an agent without the secret, wrote it. "
                "Fix: set the same WSYNC_SECRET for every torchrun agent of the job, and "
                "firewall the store's port."
            )
        return state
