"""A counting TCP proxy in front of a TCPStore: every client's requests, by command.

Clients connect to the proxy instead of the store; it forwards bytes both ways unchanged
and parses the client-to-store stream into TCPStore request frames (the wire format of
torch's ``TCPStore`` client: a command byte, then length-prefixed strings and values), so
a count is what the store's server itself has to handle. A ``get`` is two requests on the
wire (a ``wait`` for the key, then the ``get``), as the server sees it.

One selector thread serves every connection. The proxy adds a loopback hop to each round
trip, so clients that poll in a loop poll a little slower through it than without it.
"""

from __future__ import annotations

import re
import selectors
import socket
import struct
import threading
from collections import Counter

# torch's c10d::detail::QueryType, checked against the bytes a TCPStore client sends.
_NAMES = ("validate", "set", "compare_set", "get", "add", "check", "wait", "num_keys", "delete_key", "append",
          "multi_get", "multi_set", "cancel_wait", "ping", "queue_push", "queue_pop", "queue_len")  # fmt: skip
# Each command's arguments after its byte: S a length-prefixed string or value, I an 8-byte
# integer, U a 4-byte integer, N a count of strings, M a count of (string, value) pairs.
_ARGS = ("U", "SS", "SSS", "S", "SI", "N", "N", "", "S", "SS", "N", "M", "", "U", "SS", "S", "S")
_U64 = struct.Struct("<Q")
_CHUNK = 1 << 16
_NUMBERS = re.compile(rb"[0-9]+")
_HEX_TAIL = re.compile(rb"[0-9a-f]{8,}")


class ProtocolError(Exception):
    """Bytes that are not a TCPStore request (a client other than torch's, or a newer protocol)."""


def parse_request(buf: bytes | bytearray, at: int) -> tuple[str, int] | None:
    """The request starting at ``buf[at]``: its command and where the next begins; None while incomplete."""
    got = parse_request_key(buf, at)
    return None if got is None else (got[0], got[1])


def key_pattern(key: bytes) -> str:
    """A key with its numbers (ids, epochs, versions) and hex tokens collapsed: ``member/#/hb``."""
    return _NUMBERS.sub(b"#", _HEX_TAIL.sub(b"*", key)).decode("utf-8", "replace")


def parse_request_key(buf: bytes | bytearray, at: int) -> tuple[str, int, bytes] | None:
    """As :func:`parse_request`, with the request's first key (b"" for commands without one)."""
    if at >= len(buf):
        return None
    code = buf[at]
    if code >= len(_NAMES):
        raise ProtocolError(f"unknown TCPStore command byte {code} at offset {at}")
    pos = at + 1
    key: bytes | None = None
    for arg in _ARGS[code]:
        if arg == "U":
            pos += 4
        elif arg == "I":
            pos += 8
        else:
            if pos + 8 > len(buf):
                return None
            (n,) = _U64.unpack_from(buf, pos)
            pos += 8
            if arg == "S":
                if key is None:
                    key = bytes(buf[pos : pos + n])
                pos += n
            else:
                for _ in range(n if arg == "N" else 2 * n):
                    if pos + 8 > len(buf):
                        return None
                    size = _U64.unpack_from(buf, pos)[0]
                    if key is None:
                        key = bytes(buf[pos + 8 : pos + 8 + size])
                    pos += 8 + size
        if pos > len(buf):
            return None
    return _NAMES[code], pos, key or b""


class _Pair:
    """One client connection and its connection to the store."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.pending = bytearray()  # client bytes not yet parsed into a whole request
        self.out = {client: bytearray(), upstream: bytearray()}  # bytes waiting to be written to each socket
        self.parsing = True


class CountingProxy:
    """Listen on ``host:0``, forward to ``upstream``, count requests; a context manager.

    Example::

        with CountingProxy("127.0.0.1", store.port) as proxy:
            client = TCPStore("127.0.0.1", proxy.port, is_master=False)
            client.set("k", "v")
            assert proxy.snapshot()["set"] == 1
    """

    def __init__(self, upstream_host: str, upstream_port: int, *, host: str = "127.0.0.1") -> None:
        self._upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self.address = f"{host}:{self.port}"
        self.unparsed = 0  # connections whose stream stopped parsing (still forwarded)
        self._counts: Counter[str] = Counter()
        self._keys: Counter[str] = Counter()  # "command key-pattern" -> requests
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pairs: dict[socket.socket, _Pair] = {}
        self._held = False  # clients' requests are counted and kept here, not forwarded (hold())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wsync-bench-store-proxy", daemon=True)
        self._thread.start()

    def snapshot(self) -> Counter[str]:
        """Requests counted so far, by command."""
        with self._lock:
            return Counter(self._counts)

    def snapshot_keys(self) -> Counter[str]:
        """Requests counted so far, by command and key pattern (``"get member/#/hb"``)."""
        with self._lock:
            return Counter(self._keys)

    def hold(self) -> None:
        """From now on, count what the clients send but keep it here: the store sees none of it
        (and answers nothing sent since) until :meth:`release`, which forwards it all in order.
        Closing a client's connection meanwhile drops what was kept for it."""
        with self._lock:
            self._held = True

    def release(self) -> None:
        with self._lock:
            self._held = False
        self._wake_w.send(b"r")

    @property
    def connections(self) -> int:
        return len({id(p) for p in self._pairs.values()})

    def close(self) -> None:
        self._stop.set()
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for sock in [*self._pairs, self._listener, self._wake_r, self._wake_w]:
            sock.close()
        self._selector.close()

    def __enter__(self) -> CountingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, events in self._selector.select(timeout=1.0):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    self._accept()
                elif sock is self._wake_r:
                    sock.recv(64)
                    for pair in {id(p): p for p in self._pairs.values()}.values():  # released: what was kept
                        self._flush(pair, pair.upstream)
                elif sock in self._pairs:
                    self._serve(sock, events)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            upstream = socket.create_connection(self._upstream, timeout=10)
        except OSError:
            client.close()
            return
        pair = _Pair(client, upstream)
        for sock in (client, upstream):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pairs[sock] = pair
            self._selector.register(sock, selectors.EVENT_READ, None)

    def _serve(self, sock: socket.socket, events: int) -> None:
        pair = self._pairs[sock]
        other = pair.upstream if sock is pair.client else pair.client
        if events & selectors.EVENT_WRITE:
            self._flush(pair, sock)
        if not events & selectors.EVENT_READ:
            return
        try:
            data = sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(pair)
            return
        if sock is pair.client:
            self._count(pair, data)
        pair.out[other] += data
        self._flush(pair, other)

    def _flush(self, pair: _Pair, sock: socket.socket) -> None:
        if sock is pair.upstream and self._held:
            return
        out = pair.out[sock]
        try:
            while out:
                sent = sock.send(out)
                del out[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(pair)
            return
        if sock in self._pairs:
            self._selector.modify(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if out else 0), None)

    def _count(self, pair: _Pair, data: bytes) -> None:
        if not pair.parsing:
            return
        buf = pair.pending
        buf += data
        at, seen, by_key = 0, Counter[str](), Counter[str]()
        try:
            while (got := parse_request_key(buf, at)) is not None:
                name, at, key = got
                seen[name] += 1
                by_key[f"{name} {key_pattern(key)}"] += 1
        except ProtocolError:
            pair.parsing = False
            self.unparsed += 1
        del buf[:at]
        with self._lock:
            self._counts.update(seen)
            self._keys.update(by_key)

    def _drop(self, pair: _Pair) -> None:
        for sock in (pair.client, pair.upstream):
            if self._pairs.pop(sock, None) is not None:
                self._selector.unregister(sock)
                sock.close()
