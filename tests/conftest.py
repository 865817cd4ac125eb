"""Shared fixtures: free ports, leak checks, and child processes cleaned up by PID."""

from __future__ import annotations

import os
import random
import socket
import threading
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from _spawn import CTX
from _workers import thread_stacks

from lightning_wsync.testing.procs import Children
from lightning_wsync.testing.stores import host_store

# Every process a test starts (spawned workers, receivers, torchrun's) inherits this: a native
# crash (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) dumps each of its threads' Python stacks to its
# stderr. pytest enables the same in its own process.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

_PORTS = (20000, 32000)  # below Linux's ephemeral range (32768-60999)
_RNG = random.SystemRandom()  # independent of any seed a test sets


def free_port() -> int:
    """A port free now, drawn below the ephemeral range: a port the kernel hands out with
    ``bind(0)`` can be taken, before the test binds it, as the source port of any outgoing
    connection on the machine (seen in CI: a sender's store then could not listen)."""
    for _ in range(200):
        candidate = _RNG.randrange(*_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("", candidate))
            except OSError:
                continue
            return candidate
    raise RuntimeError(f"no free port in {_PORTS}")


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def server(port: int) -> Iterator[dist.TCPStore]:
    """A TCPStore hosted by the test itself at ``port`` (the control plane a sender joins), as the
    package hosts one: on an IPv4 socket, so that accepting a client never waits for DNS."""
    store = host_store("127.0.0.1", port, timeout_s=30)
    yield store
    del store


LEFT_BEHIND = ("wsync-relay-head-send-v", "wsync-relay-tree-send-v", "wsync-relay-tree0", "wsync-relay-tree1")
LEFT_BEHIND_S = 20.0


_REPORTED: set[threading.Thread] = set()  # threads a leak check already failed a test for


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves wsync threads running or changes WSYNC_* variables."""
    env_before = {k: v for k, v in os.environ.items() if k.startswith("WSYNC_")}
    yield
    for t in threading.enumerate():
        if t.name.startswith("wsync-") and t not in _REPORTED:
            t.join(timeout=5)
    # A relay head's send left behind by a re-formed chain or trees (hops.send_apart) is stuck in a
    # gloo send its peer stopped reading: nothing wakes it before its group's timeout (the sender's
    # timeout_s, 20 s at most in these tests), after which it ends on its own. So is a tree leader's
    # half thread that a superseded version left in a receive gloo does not wake when its pair closes
    # (leader/treehop.py; seen at teardown in test_relay_sharded's one-chunk case). Held to that bound.
    for t in threading.enumerate():
        if t.name.startswith(LEFT_BEHIND) and t not in _REPORTED:
            t.join(timeout=LEFT_BEHIND_S)
    leaked = [t for t in threading.enumerate() if t.name.startswith("wsync-") and t.is_alive()]
    new = [t for t in leaked if t not in _REPORTED]
    _REPORTED.update(leaked)
    # Each leaked thread is blamed on the test that left it, with where it waits; later tests
    # check only their own (a stuck thread once failed four tests after its own, saying nothing of why).
    assert not new, f"threads left running: {[t.name for t in new]}\n{thread_stacks(new)}"
    env_after = {k: v for k, v in os.environ.items() if k.startswith("WSYNC_")}
    assert env_after == env_before, "test leaked WSYNC_* environment variables"


@pytest.fixture
def children() -> Iterator[Children]:
    """Processes a test starts (``children.track(pid)``); all SIGKILLed, by PID, when it ends."""
    with Children(join_timeout_s=0, context=CTX) as c:
        yield c
