"""Issue 32, finding 3: a tree leader's half-thread left behind by a superseded version (gloo
does not wake every wait on an interrupted pair) must not rebuild its delta chunks into the
target once a later version has it. The pairs are in-process stand-ins that keep delivering
after ``interrupt()``, the worst gloo does."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import pytest
import torch

from lightning_wsync._control.manifest import Manifest, build_manifest, checksum
from lightning_wsync._planes.delta.encode import DeltaStreams
from lightning_wsync._planes.delta.wire import held_of
from lightning_wsync._planes.relay import exits
from lightning_wsync._planes.relay.hops import Superseded, chunks, hop_header
from lightning_wsync._planes.relay.leader.hop import HopReceiver
from lightning_wsync._planes.relay.leader.treehop import TreeHop
from lightning_wsync._planes.relay.treedelta import chunk_layout, half_messages
from lightning_wsync._planes.wire import DELTA, FULL, trailer_words

pytestmark = pytest.mark.timeout(60)


class _Work:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.done = threading.Event()

    def wait(self) -> bool:
        if not self.done.wait(30):
            raise RuntimeError("nothing landed in 30 s")
        return True


class _Pair:
    """One side of a hop: messages land, in order, in the receives posted, whatever interrupt() said."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._messages: deque[torch.Tensor] = deque()
        self._posted: deque[_Work] = deque()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        work = _Work(tensors[0])
        with self._lock:
            self._posted.append(work)
            self._match()
        return work

    def feed(self, messages: Sequence[torch.Tensor]) -> None:
        with self._lock:
            self._messages.extend(messages)
            self._match()

    def consumed(self) -> bool:
        with self._lock:
            return not self._messages

    def interrupt(self) -> None:
        pass  # a receive whose data was landing is not woken

    def _match(self) -> None:
        while self._posted and self._messages:
            work, message = self._posted.popleft(), self._messages.popleft()
            into = work.tensor.view(torch.uint8)
            data = message.contiguous().view(torch.uint8).flatten()
            assert into.numel() == data.numel(), f"a receive of {into.numel()} bytes met {data.numel()}"
            into.copy_(data)
            work.done.set()


def _layout() -> Manifest:
    tensors = {f"w{i}": torch.zeros(300_000 + 999 * i, dtype=torch.float32) for i in range(2)}
    return build_manifest(tensors, torch.bfloat16, bucket_bytes=1 << 19)


def _until(what: str, condition: object, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.005)


def _superseded(hop: TreeHop, pairs: list[_Pair], what: str, halves_waiting: Callable[[], bool]) -> None:
    """``hop.receive_both`` on ``pairs`` until ``halves_waiting()``, then the topology changes:
    it raises ``Superseded`` and leaves its half threads behind."""
    current = threading.Event()
    current.set()
    outcome: list[BaseException] = []

    def receive() -> None:
        try:
            hop.receive_both(pairs, [[], []], current.is_set)  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome.append(exc)

    one = threading.Thread(target=receive)
    one.start()
    _until(what, halves_waiting)
    current.clear()  # the topology changed mid-version
    one.join(20)
    assert len(outcome) == 1 and isinstance(outcome[0], Superseded), outcome


def test_a_superseded_half_thread_never_rebuilds_into_a_later_versions_target() -> None:
    layout = _layout()
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8, generator=gen)
    new = base.clone()
    words = new.view(torch.int16)
    words[torch.randint(0, words.numel(), (words.numel() // 10,), generator=gen)] ^= 1
    later = torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8, generator=gen)
    pieces = chunks(layout)
    stream = DeltaStreams(layout).get(version=7, base_version=6, base=base, new=new,
                                      base_sums=[checksum(base, a, b) for a, b in layout.buckets],
                                      layout=chunk_layout(layout))  # fmt: skip
    trailer = torch.full((trailer_words(len(layout.buckets)),), 3, dtype=torch.int64)
    receiver = HopReceiver(layout)  # no ring: each version is rebuilt in the staging buffer
    hop = TreeHop(receiver)
    receiver.staging.copy_(base)
    receiver.held = held_of(6, [checksum(base, a, b) for a, b in layout.buckets])

    # Version 7 as deltas: each half-thread gets its delta header and first batch's size, then waits for the batch.
    first = [_Pair(), _Pair()]
    rest: list[list[torch.Tensor]] = []
    for t, pair in enumerate(first):
        steps = [m for step in half_messages(new, pieces, hop.halves[t], stream) for m in step]
        pair.feed([hop_header(7, 1, layout, DELTA, len(hop.halves[t])), *steps[:2]])
        rest.append([*steps[2:], trailer])
    receiver.expect(first)  # type: ignore[arg-type]
    _superseded(hop, first, "both halves waiting for their first batch", lambda: all(p.consumed() for p in first))

    # Version 8, in full, takes the target.
    second = [_Pair(), _Pair()]
    for t, pair in enumerate(second):
        body = [later[pieces[i][0] : pieces[i][1]] for i in hop.halves[t]]
        pair.feed([hop_header(8, 2, layout, FULL, len(hop.halves[t])), *body, trailer])
    receiver.expect(second)  # type: ignore[arg-type]
    msg = hop.receive_both(second, [[], []], lambda: True)  # type: ignore[arg-type]
    assert msg.version == 8 and torch.equal(receiver.staging, later)

    # Version 7's batches land at last in the half-threads left behind.
    for pair, messages in zip(first, rest):
        pair.feed(messages)
    _until("the half-threads left behind have ended",
           lambda: not any(t.name.startswith("wsync-relay-tree") for t in threading.enumerate()))  # fmt: skip
    changed = int((receiver.staging != later).sum())
    assert changed == 0, f"{changed} bytes of version 8 rewritten by version 7's half-threads"


def test_half_threads_left_behind_by_a_superseded_version_are_waited_for_at_exit() -> None:
    """A process ending normally while a half thread left behind still waits on its pair: the exit's
    wait (the ``atexit`` handler, called here) lasts until it ends. Without it, a gloo receive that
    returns while the interpreter finalizes aborts the process (``stress_exit.py --side recv``)."""
    layout = _layout()
    pieces = chunks(layout)
    gen = torch.Generator().manual_seed(2)
    data = torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8, generator=gen)
    trailer = torch.full((trailer_words(len(layout.buckets)),), 3, dtype=torch.int64)
    receiver = HopReceiver(layout)
    hop = TreeHop(receiver, timeout_s=5.0)
    pairs = [_Pair(), _Pair()]
    for t, pair in enumerate(pairs):  # the header alone: each half waits for its first piece
        pair.feed([hop_header(1, 1, layout, FULL, len(hop.halves[t]))])
    receiver.expect(pairs)  # type: ignore[arg-type]
    _superseded(hop, pairs, "both halves waiting for their first piece",
                lambda: all(p.consumed() and p._posted for p in pairs))  # fmt: skip
    left = [t for t in threading.enumerate() if t.name.startswith("wsync-relay-tree")]
    assert len(left) == 2 and all(t.is_alive() for t in left), left

    def the_rest() -> None:  # what the old parent still had on the wire lands 0.5 s later
        for t, pair in enumerate(pairs):
            pair.feed([*(data[pieces[i][0] : pieces[i][1]] for i in hop.halves[t]), trailer])

    timer = threading.Timer(0.5, the_rest)
    started = time.monotonic()
    timer.start()
    exits.join_at_exit()
    waited = time.monotonic() - started
    running = [t.name for t in left if t.is_alive()]
    timer.join()
    assert not running, f"the exit's wait returned after {waited:.2f} s with {running} still running"
    assert 0.4 <= waited < 5.0 + 1.0, waited
