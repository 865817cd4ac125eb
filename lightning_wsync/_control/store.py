"""The control plane: connection to the shared store, host facts, and :class:`Control`,
the one error boundary for a job's keys (their layout: :mod:`lightning_wsync._control.keys`).

Longer than 300 lines: every store operation goes through the one class, so that no
``RuntimeError`` of the store escapes it unnamed.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from lightning_wsync._control import inflight, keys
from lightning_wsync._control.checks import RecordShape, parse_counter
from lightning_wsync._control.keys import ENV_JOB, ENV_STORE
from lightning_wsync._control.records import R, Record
from lightning_wsync._control.signing import Signer, derive_key, short
from lightning_wsync.errors import (
    WeightSyncAuthError,
    WeightSyncError,
    WeightSyncRecordError,
    WeightSyncStoreError,
)

_T = TypeVar("_T")
log = logging.getLogger(__name__)
_CLONE_WARNED: list[bool] = []  # Control.clone() fell back to a shared connection (said once)

# What the store boundary raises: the store itself (lost, timed out), and a record that does not
# decode or verify (Control.get_record, decode). A caller that outlives the store catches these, no wider.
STORE_ERRORS = (WeightSyncStoreError, WeightSyncRecordError, WeightSyncAuthError)


@dataclass(frozen=True)
class StoreHandle:
    """A connected store plus what is known about where it lives."""

    store: dist.Store
    address: str | None  # "host:port" when known
    is_server: bool  # this process hosts the TCPStore


def resolve_job(job: str | None, owner: str) -> str:
    job = job if job is not None else os.environ.get(ENV_JOB)
    if not job:
        raise ValueError(
            f"{owner}: job={job!r}; pass job='<run name>' or set {ENV_JOB} (torchrun with "
            f"--rdzv-backend=wsync sets it to the --rdzv-id)"
        )
    if "/" in job:
        raise ValueError(f"{owner}: job={job!r} must not contain '/'; pick a name like 'exp1'")
    return job


def tcp_store(host: str, port: int, *, serve: bool, timeout_s: float, multi_tenant: bool = True) -> dist.TCPStore:
    """Host (``serve``) or join the TCPStore at ``host:port``; every TCPStore of the package is made here.

    A hosted store does not wait for clients and, by default, is multi-tenant: another store
    object of this process may host the same port and shares the server. At an IPv4 address
    it accepts on an IPv4 socket of its own (:func:`_ipv4_listener`). Raises what
    ``TCPStore`` raises (``RuntimeError``, ``OSError``, ``ValueError``); callers say what failed.
    """
    timeout = timedelta(seconds=timeout_s)
    if not serve:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    listener = _ipv4_listener(host, port)
    if listener is None:
        return dist.TCPStore(host, port, is_master=True, multi_tenant=multi_tenant, wait_for_workers=False,
                             timeout=timeout)  # fmt: skip
    bound = listener.getsockname()[1]
    # The server owns the descriptor from here, and closes it (on its own error too).
    return dist.TCPStore(host, bound, is_master=True, multi_tenant=multi_tenant, wait_for_workers=False,
                         timeout=timeout, master_listen_fd=listener.detach())  # fmt: skip


def _ipv4_listener(host: str, port: int) -> socket.socket | None:
    """An IPv4 socket listening on every address at ``port``, when ``host`` is an IPv4 address
    or a name with IPv4 addresses only.

    torch's own server listens on an IPv6 socket, which sees an IPv4 client as
    ``::ffff:a.b.c.d``, and its event loop looks up the name of every client it accepts: a
    reverse lookup that ``/etc/hosts`` does not answer in that form, so it goes to DNS, and
    where the resolver loses the query every request of every client waits the resolver's
    timeout (5 s) behind it. Accepted on an IPv4 socket, a client is ``a.b.c.d``, which
    ``/etc/hosts`` answers for loopback and listed hosts (docs/control-plane.md, "Connects
    that take 5 s"). None (torch binds as it does) for an IPv6 address, a name with one, or
    a port this process cannot bind (another server has it).
    """
    try:
        if ipaddress.ip_address(host).version != 4:
            return None
    except ValueError:  # a name
        try:
            found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return None
        if not found or any(family != socket.AF_INET for family, *_ in found):
            return None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own listener
        sock.bind(("0.0.0.0", port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        return None
    return sock


def connect_store(
    spec: dist.Store | str | None, *, serve: bool, timeout_s: float, owner: str
) -> StoreHandle:
    """Open the control-plane store.

    ``spec`` is a Store, ``"host:port"``, or None for ``$WSYNC_STORE``. With ``serve``
    a TCPStore is hosted at that address when the port can be bound here (or is 0);
    otherwise this process connects as a client.
    """
    if isinstance(spec, dist.Store):
        return StoreHandle(spec, None, False)
    if spec is None:
        spec = os.environ.get(ENV_STORE)
        if not spec:
            raise ValueError(
                f"{owner}: store=None and {ENV_STORE} is not set; pass store='host:port' (or a "
                f"torch.distributed.Store), or launch with torchrun --rdzv-backend=wsync which sets {ENV_STORE}"
            )
    if not isinstance(spec, str):
        raise TypeError(f"{owner}: store={spec!r} must be a torch.distributed.Store or a 'host:port' string")
    host, port = parse_address(spec, f"{owner}: store")
    if serve:
        try:
            server = tcp_store(host, port, serve=True, timeout_s=timeout_s)
            return StoreHandle(server, f"{host}:{server.port}", True)
        except (RuntimeError, OSError):
            if port == 0:
                raise WeightSyncStoreError(
                    f"{owner}: could not host a TCPStore on {host!r} with a free port; pass a "
                    f"local address as store='ADDR:0'"
                ) from None
            # Port taken (the torchrun agent or another sender hosts it): join as a client.
    try:
        client = tcp_store(host, port, serve=False, timeout_s=timeout_s)
    except (RuntimeError, OSError) as exc:
        raise WeightSyncStoreError(
            f"{owner}: cannot reach the control-plane store at {spec!r} within timeout_s={timeout_s}: "
            f"{_first_line(exc)}; start the trainer (or `lightning-wsync store`) first, or fix store="
        ) from exc
    return StoreHandle(client, f"{host}:{port}", False)


def parse_address(spec: str, what: str) -> tuple[str, int]:
    host, sep, port_text = spec.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ValueError(f"{what}={spec!r} is not 'host:port' (e.g. '127.0.0.1:29400')")
    return host.strip("[]"), int(port_text)


class Control:
    """Typed access to one job's keys on the store. Thread-safe as the store is.

    The one error boundary for store operations: a ``RuntimeError`` from the store
    becomes :class:`WeightSyncStoreError` naming the operation and key, so callers tell
    a lost store from any other failure by type; a record that does not decode is a
    :class:`WeightSyncRecordError`, one not signed right a :class:`WeightSyncAuthError`.
    """

    def __init__(
        self, store: dist.Store, job: str, secret: bytes | None = None, *, _run: list[str] | None = None
    ) -> None:
        self.job = job
        self.raw = store
        self.secret = None if secret is None else derive_key(secret, job)  # the HMAC key, never the raw secret
        self._secret = secret
        self.store = dist.PrefixStore(keys.job_prefix(job), store)  # PrefixStore adds the "/"
        self._timeout_s: float = self.store.timeout.total_seconds()  # type: ignore[attr-defined]  # missing from stubs
        self._run = _run if _run is not None else []  # shared with clones: read once per process
        self._signer = Signer(keys.job_prefix(job), self.secret, self.run_id)

    def clone(self) -> Control:
        """A second connection (where the store supports it) for a thread that may block.

        A TCPStore that cannot connect again within its timeout (seen under CI's load: "timed
        out after 3000ms while trying to connect") leaves the thread on this connection, which
        works but serialises its waits with this one's users: said once per process, as it
        explains a stall that would otherwise look like the peer's.
        """
        clone = getattr(self.raw, "clone", None)
        if clone is None:
            return self  # a store without a second connection (HashStore, PrefixStore)
        try:
            return Control(clone(), self.job, self._secret, _run=self._run)
        except RuntimeError as exc:
            if not _CLONE_WARNED:
                _CLONE_WARNED.append(True)
                log.warning("store: a second connection to the store failed (%s); this thread shares its "
                            "owner's connection, so its blocking waits delay the owner's requests "
                            "(raise timeout_s on a loaded host)", str(exc).strip().splitlines()[0][:200])  # fmt: skip
            return self

    # -- signed records -------------------------------------------------------------
    def run_id(self) -> str:
        """This run's identity, bound into every MAC: a random token that the first signing
        peer stores under ``run`` (compare-and-set, so every peer reads the same one)."""
        if not self._run:
            mine = secrets.token_hex(16)
            self._run.append(self.compare_set(keys.RUN, "", mine).decode("utf-8", "replace"))
        return self._run[0]

    def seal(self, key: str, value: object) -> str:
        """``value`` as JSON, wrapped with an HMAC over key, run and body when a secret is set."""
        return self._signer.seal(key, value)

    def open(self, key: str, raw: bytes | str) -> object:
        """Inverse of :meth:`seal`; raises only WeightSyncRecordError or WeightSyncAuthError."""
        return self._signer.open(key, raw, self.job)

    def decode(self, key: str, raw: bytes | str, kind: type[R]) -> R:
        """The record of type ``kind`` sealed in ``raw`` (read from ``key``)."""
        value = self.open(key, raw)
        try:
            return kind.decode(value)
        except (RecordShape, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise WeightSyncRecordError(
                f"record {key!r} of job {self.job!r} holds {short(json.dumps(value))}: {exc}; expected "
                f"{kind.EXPECTED}. It is ignored until its writer replaces it; only lightning_wsync should "
                f"write under wsync/{self.job}/"
            ) from None

    def get_record(self, key: str, kind: type[R]) -> R | None:
        """The record of type ``kind`` at ``key`` (verified when a secret is set), or None when absent."""
        text = self.get_text(key)
        return None if text is None else self.decode(key, text, kind)

    def put(self, key: str, record: Record) -> None:
        self.set_json(key, record.encode())

    def mac_bytes(self, message: bytes) -> bytes:
        """HMAC-SHA256 of ``message`` within this job and run (32 zero bytes without a secret)."""
        return self._signer.mac_bytes(message)

    # -- primitives ---------------------------------------------------------------
    def _call(
        self, op: str, key: str, call: Callable[[], _T], bound_s: float | None = None,
        wake: Callable[[], None] | None = None,
    ) -> _T:  # fmt: skip
        """``call`` (one store operation bounded by ``bound_s``, the store's timeout by default),
        with its ``RuntimeError`` named; the process's exit waits for it (:mod:`.inflight`)."""
        if bound_s is None:
            bound_s = self._timeout_s
        try:
            with inflight.store_call(bound_s, wake):
                return call()
        except WeightSyncError:
            raise
        except RuntimeError as exc:
            raise WeightSyncStoreError(
                f"control-plane store of job {self.job!r}: {op} {key!r} failed ({_first_line(exc)}); the "
                f"store's host (the trainer's torchrun agent or `lightning-wsync store`) is gone or unreachable"
            ) from exc

    def has(self, key: str) -> bool:
        return self._call("check", key, lambda: bool(self.store.check([key])))

    def list_keys(self, prefix: str) -> list[str] | None:
        """This job's keys that start with ``prefix`` (without the job's prefix), or None where the
        store cannot list its keys (only a ``TCPStore`` can; a ``PrefixStore`` answers ``[]``)."""
        if not isinstance(self.raw, dist.TCPStore):
            return None
        mine = f"{keys.job_prefix(self.job)}/"
        every = self._call("list_keys", prefix, lambda: list(self.raw.list_keys()))
        return [k[len(mine) :] for k in every if k.startswith(mine + prefix)]

    def has_all(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` exists, in one request."""
        return self._call("check", keys[0] if keys else "", lambda: bool(self.store.check(keys)))

    def wait_for(self, key: str, timeout_s: float, *, private: bool = True) -> bool:
        """Block until ``key`` exists (True) or ``timeout_s`` passes (False), in one request.

        The store answers when the key is set, so a waiter costs no polls; keep ``timeout_s``
        short enough for the caller's own deadlines, and call it on a :meth:`clone` only: the
        connection is busy for the whole wait. ``private``: only the waiter reads ``key``, so
        the process's exit may end the wait by writing it (:meth:`_waker`); a key others read
        (a record) is never written so, and its wait is waited for at exit, up to its bound.
        """
        wait_s = max(0.001, timeout_s)
        try:
            self._call("wait for", key, lambda: self.store.wait([key], timedelta(seconds=wait_s)),
                       bound_s=wait_s + 1.0, wake=self._waker(key) if private else None)  # fmt: skip
        except WeightSyncStoreError as exc:
            if isinstance(exc.__cause__, dist.DistStoreError):  # the wait's own timeout; a lost store is another error
                return False
            raise
        return True

    def _waker(self, key: str) -> Callable[[], None] | None:
        """What ends a wait for ``key`` from another thread (the exit's: :mod:`.inflight`): ``key``
        written on a connection of its own (a TCPStore's, made then) or on an in-process store;
        None where the only connection could be the one waiting (a ``PrefixStore`` over another)."""
        raw = self.raw
        if not isinstance(raw, (dist.TCPStore, dist.HashStore, dist.FileStore)):
            return None
        prefix = keys.job_prefix(self.job)

        def wake() -> None:
            store = raw
            if isinstance(raw, dist.TCPStore):  # connects within WOKEN_S, or raises
                store = tcp_store(raw.host, raw.port, serve=False, timeout_s=inflight.WOKEN_S)
            dist.PrefixStore(prefix, store).set(key, _EXIT_WAKE)

        return wake

    def get_text(self, key: str) -> str | None:
        """The value at ``key``, or None, in one request that never waits (``has`` then ``get``
        waits the store's timeout if the key goes in between; this compare-and-set never writes)."""
        seen = self._call("get", key, lambda: bytes(self.store.compare_set(key, _PROBE, _PROBE)))
        return None if seen == _PROBE.encode() else seen.decode("utf-8", "replace")

    def get_raw(self, key: str) -> bytes:
        """The bytes at ``key``, which must exist (a missing key waits for the store's timeout)."""
        return self._call("get", key, lambda: bytes(self.store.get(key)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The bytes at each of ``keys`` (all must exist), in one round trip."""
        return self._call("multi_get", keys[0] if keys else "", lambda: [bytes(v) for v in self.store.multi_get(keys)])

    def get_present(self, keys: list[str]) -> dict[str, bytes]:
        """The bytes at each of ``keys`` that exists: a check and one multi_get when all do, else
        one non-waiting read each (a multi_get would wait the store's timeout on a missing key)."""
        if keys and self.has_all(keys):
            return dict(zip(keys, self.multi_get(keys)))
        return {key: raw.encode() for key in keys if (raw := self.get_text(key)) is not None}

    def get_json(self, key: str) -> object:
        """The JSON value at ``key`` (verified when a secret is set), or None when absent."""
        text = self.get_text(key)
        return None if text is None else self.open(key, text)

    def set_text(self, key: str, value: str) -> None:
        self._call("set", key, lambda: self.store.set(key, value))

    def set_json(self, key: str, value: object) -> None:
        sealed = self.seal(key, value)
        self._call("set", key, lambda: self.store.set(key, sealed))

    def multi_set(self, values: dict[str, str]) -> None:
        """Set every key of ``values`` to its value, in one request (nothing when empty)."""
        if values:
            names = list(values)
            multi_set = self.store.multi_set  # type: ignore[attr-defined]  # missing from stubs
            self._call("multi_set", names[0], lambda: multi_set(names, [values[k] for k in names]))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is absent and ``expected`` is
        empty); returns what it holds afterwards."""
        return self._compare_set("compare_set", key, expected, desired)

    def _compare_set(self, op: str, key: str, expected: str, desired: str) -> bytes:
        return self._call(op, key, lambda: bytes(self.store.compare_set(key, expected, desired)))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter at ``key`` (0: read it; absent counts as 0).

        TCPStore's server drops the connection of a client whose ``add`` finds a value
        that is not an integer, and that client is dead from then on; a look at the value
        before an ``add`` leaves a window in which a store writer can garble it (issue 32).
        So the add is a compare-and-set from the integer read to the sum, tagged with a
        token of this call (``"7 1f3a9c0e"``: TCPStore answers a compare-and-set with the
        value it holds afterwards, so an untagged sum could be another adder's equal one),
        then set back to the plain sum where nobody moved it on. Lost to another writer, it
        reads again: each retry means another write got in, so honest adders cannot starve
        one another. A non-integer raises :class:`WeightSyncRecordError` and the connection
        stays. A read (``amount=0``) is one round trip.
        """
        for _ in range(_ADD_TRIES):
            seen = self._call("add", key, lambda: bytes(self.store.compare_set(key, _PROBE, _PROBE)))
            if seen == _PROBE.encode():
                count, expected = 0, ""
            else:
                parsed = parse_counter(seen)
                if parsed is None:
                    raise WeightSyncRecordError(
                        f"counter {key!r} of job {self.job!r} holds {short(seen)}, not an integer; it is not "
                        f"touched (the store would drop this client). Only lightning_wsync should write "
                        f"under wsync/{self.job}/"
                    )
                count, expected = parsed, seen.decode("ascii")
            if amount == 0:
                return count
            total = count + amount
            tagged = f"{total} {secrets.token_hex(8)}"
            if self._compare_set("add", key, expected, tagged) == tagged.encode():
                self._compare_set("add", key, tagged, str(total))
                return total
        raise WeightSyncStoreError(
            f"control-plane store of job {self.job!r}: add {key!r} lost {_ADD_TRIES} compare-and-sets in a row "
            f"to other writers; only lightning_wsync should write under wsync/{self.job}/"
        )

    def bump(self, key: str) -> None:
        """Change the "look again" counter at ``key``: one more, or when someone garbled it, a
        fresh value (any change is the signal; nobody reads such a counter as a number).

        By compare-and-set, never ``add``: TCPStore's server drops the connection of a client
        whose ``add`` meets a non-integer, and a store writer could garble the key between a
        check and the ``add`` (seen in the chaos test: the sender's connection lost at a push).
        Either outcome of the compare-and-set changed the key: this one's write, or another's.
        """
        seen = self._call("bump", key, lambda: bytes(self.store.compare_set(key, _PROBE, _PROBE)))
        count = 0 if seen == _PROBE.encode() else parse_counter(seen)
        expected = "" if seen == _PROBE.encode() else seen.decode("utf-8", "strict") if seen.isascii() else None
        desired = str(time.time_ns()) if count is None else str(count + 1)
        if expected is not None:
            now = self._call("bump", key, lambda: bytes(self.store.compare_set(key, expected, desired)))
            if now != seen:
                return
        self.set_text(key, desired)  # bytes a compare-and-set cannot name: overwritten

    def queue_len(self, key: str) -> int:
        return self._call("queue_len", key, lambda: int(self.store.queue_len(key)))

    def queue_push(self, key: str, item: bytes) -> None:
        self._call("queue_push", key, lambda: self.store.queue_push(key, item))

    def queue_pop(self, key: str) -> bytes | None:
        """The oldest item of the queue at ``key``, or None when it is empty (never blocks)."""
        try:
            return self._call("queue_pop", key, lambda: bytes(self.store.queue_pop(key, block=False)))
        except WeightSyncStoreError as exc:
            if isinstance(exc.__cause__, dist.QueueEmptyError):
                return None
            raise

    def delete(self, key: str) -> None:
        try:
            with inflight.store_call(self._timeout_s):
                self.store.delete_key(key)
        except RuntimeError:
            pass  # stores without delete (FileStore on old torch) keep the key; harmless

    def prefix_store(self, prefix: str) -> dist.Store:
        return dist.PrefixStore(prefix, self.store)


_ADD_TRIES = 10_000  # compare-and-sets lost in a row before add gives up
_PROBE = "\x00wsync-probe"  # never a value: compare_set(key, _PROBE, _PROBE) only reads
_EXIT_WAKE = "wake"  # what the process's exit writes into a key a thread of it waits for


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
