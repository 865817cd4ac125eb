"""Records a receiver trusts, the experience channel, shared segments, and configuration errors."""

from __future__ import annotations

import json
import os
import signal
import struct
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _spawn import CTX
from _workers import mixed_model

from lightning_wsync import (
    WeightReceiver,
    WeightSender,
    WeightSyncAuthError,
    WeightSyncConfigError,
    WeightSyncIntegrityError,
)
from lightning_wsync._control.host import host_id
from lightning_wsync.channel import ExperienceReader, ExperienceWriter

pytestmark = pytest.mark.timeout(90)


def _raw(port: int, job: str) -> dist.Store:
    return dist.PrefixStore(f"wsync/{job}", dist.TCPStore("127.0.0.1", port, is_master=False))


# -- records a receiver trusts ------------------------------------------------------------
def test_forged_sender_pointer_is_refused_by_name(server, port):
    store = f"127.0.0.1:{port}"
    with WeightSender(mixed_model(0), store=store, job="p", secret="k", timeout_s=5) as sender:
        sender.push(1)
        _raw(port, "p").set("sender/current", "1000")  # a stranger hides the real sender (epoch 1)
        with (
            WeightReceiver(mixed_model(1), store=store, job="p", secret="k", timeout_s=5) as receiver,
            pytest.raises(WeightSyncAuthError, match="record 'sender/current' of job 'p' is not signed"),
        ):
            receiver.wait_for_version(1, timeout_s=5)


def _forge_sender(port: int, job: str, layout: dict[str, Any], **record: object) -> None:
    raw = _raw(port, job)
    fields = {"epoch": 99, "host": host_id(), "pid": 1, "transport": "auto", "backend": "gloo", "addr": "127.0.0.1",
              "heartbeat_timeout_s": 10, "timeout_s": 5, "relay": False, "shm": None}  # fmt: skip
    raw.set("sender/99", json.dumps({**fields, **record}))
    raw.set("layout/99", json.dumps(layout))
    raw.set("sender/current", json.dumps({"epoch": 99}))


@pytest.mark.parametrize(
    ("shm", "match"),
    [
        ("../../tmp/wsync-evil", r"segment name '\.\./\.\./tmp/wsync-evil' .* is not one lightning_wsync creates"),
        ("wsync-1-99-link", r"segment '/dev/shm/wsync-1-99-link' is a symbolic link; refused"),
    ],
)
def test_segment_names_from_the_store_are_validated(server, port, tmp_path, shm, match):
    """Without a secret anyone can write a sender record: its segment name is checked
    before anything is opened, and a symlink is never followed."""
    target = tmp_path / "not-a-segment"
    target.write_bytes(bytes(1 << 16))
    link = "/dev/shm/wsync-1-99-link"
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(target, link)
    try:
        src = mixed_model(0)
        with WeightSender(src, store=f"127.0.0.1:{port}", job="s", transport="gloo", timeout_s=5) as sender:
            _forge_sender(port, "s", sender.layout.to_json(), shm=shm)
            with (
                WeightReceiver(mixed_model(1), store=f"127.0.0.1:{port}", job="s", timeout_s=5) as receiver,
                pytest.raises(WeightSyncConfigError, match=match),
            ):
                receiver.wait_for_version(0, timeout_s=5)
    finally:
        os.unlink(link)


def test_shm_transport_across_hosts_is_a_configuration_error(server, port, monkeypatch):
    store = f"127.0.0.1:{port}"
    monkeypatch.setenv("WSYNC_HOST_ID", "host-a")
    with WeightSender(mixed_model(0), store=store, job="h", transport="shm", timeout_s=5) as sender:
        sender.push(1)
        monkeypatch.setenv("WSYNC_HOST_ID", "host-b")
        with (
            WeightReceiver(mixed_model(1), store=store, job="h", timeout_s=30) as receiver,
            pytest.raises(WeightSyncConfigError, match="the sender uses transport='shm' but runs on host 'host-a'"),
        ):
            receiver.wait_for_version(1, timeout_s=3)
        assert receiver.store_lost_s is None  # never reported as a lost store


# -- experience channel --------------------------------------------------------------------
# The items are in the queue before each reader starts, so a reader returns or raises at
# once; idle_timeout_s also bounds the reader's connect to the store, and a 5 s connect
# to a store in this process timed out once in a few hundred runs on a loaded machine.
def test_channel_items_are_signed(server, port):
    store = f"127.0.0.1:{port}"
    ExperienceWriter(store=store, job="c", secret="k").put({"x": torch.ones(2)}, 3)
    (item,) = ExperienceReader(store=store, job="c", secret="k", max_items=1, idle_timeout_s=30)
    assert int(item["version"]) == 3 and torch.equal(item["x"], torch.ones(2))

    ExperienceWriter(store=store, job="c").put({"x": torch.ones(2)}, 4)  # a writer without the secret
    with pytest.raises(WeightSyncAuthError, match="channel 'experience': an item of .* bytes is not signed"):
        next(iter(ExperienceReader(store=store, job="c", secret="k", idle_timeout_s=30)))
    ExperienceWriter(store=store, job="c", secret="guess").put({"x": torch.ones(2)}, 5)
    with pytest.raises(WeightSyncAuthError, match="is signed with a different secret; it was dropped"):
        next(iter(ExperienceReader(store=store, job="c", secret="k", idle_timeout_s=30)))


def _item(header: bytes) -> bytes:
    """An unsigned channel item: no signature, header length, header (and what follows it)."""
    body = header.split(b"}xx")[0] + b"}" if header.endswith(b"}xx") else header
    return bytes(32) + struct.pack("<I", len(body)) + header


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\x05", r"malformed \(shorter than its signature\)"),
        (bytes(32) + b"\xff\xff\x00\x00{", "malformed: header length 65535 runs past the end"),
        (bytes(32) + b"\x02\x00\x00\x00{]", "malformed: Expecting property name"),
        (_item(b'{"version":1,"tensors":[["x","float32",[1000000000]]]}'), r"'x' needs 4000000000 bytes at offset"),
        (_item(b'{"version":1,"tensors":[["x","os.system",[1]]]}'), "unknown dtype 'os.system'"),
        (_item(b'{"version":1,"tensors":[["x","float32",[-1]]]}'), r"shape \[-1\] of 'x' is not a list of ints >= 0"),
        (_item(b'{"version":"1","tensors":[]}'), "version '1' is not an int"),
        (_item(b'{"version":1,"tensors":[]}xx'), "2 bytes left over after the tensors"),
    ],
)
def test_malformed_channel_items_get_a_clear_error(server, port, payload, match):
    _raw(port, "m").queue_push("channel/experience/queue", payload)
    with pytest.raises(WeightSyncIntegrityError, match=match):
        next(iter(ExperienceReader(store=f"127.0.0.1:{port}", job="m", idle_timeout_s=30)))


def test_oversized_channel_items_are_refused_on_both_sides(server, port):
    store = f"127.0.0.1:{port}"
    with pytest.raises(ValueError, match=r"encodes to \d+ bytes, above max_item_mb=0.001; put smaller items"):
        ExperienceWriter(store=store, job="o", max_item_mb=0.001).put({"x": torch.zeros(1000)}, 1)
    ExperienceWriter(store=store, job="o").put({"x": torch.zeros(1000)}, 1)
    with pytest.raises(WeightSyncIntegrityError, match=r"is above max_item_mb=0.001; it was dropped"):
        next(iter(ExperienceReader(store=store, job="o", max_item_mb=0.001, idle_timeout_s=30)))


class _DiesInPush:
    """A store whose queue_push kills the process: a writer SIGKILLed mid-put."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def queue_len(self, key: str) -> int:
        return int(self._store.queue_len(key))

    def queue_push(self, key: str, value: bytes) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def _dying_writer_main(store: str) -> None:
    writer = ExperienceWriter(store=store, job="k", capacity=2)
    writer._queue._ctl.store = _DiesInPush(writer._queue._ctl.store)  # type: ignore[assignment]
    writer.put({"x": torch.ones(1)}, 1)


def test_writer_killed_mid_put_leaks_no_capacity(server, port, children):
    store = f"127.0.0.1:{port}"
    proc = CTX.Process(target=_dying_writer_main, args=(store,), daemon=True)
    proc.start()
    children.track(proc.pid)
    proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL
    writer = ExperienceWriter(store=store, job="k", capacity=2)
    assert writer.put({"x": torch.ones(1)}, 2, block=False) and writer.put({"x": torch.ones(1)}, 3, block=False)
    assert writer.put({"x": torch.ones(1)}, 4, block=False) is False  # still bounded
