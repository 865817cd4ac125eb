"""The bench's counting proxy: each TCPStore request counted once, by command, bytes forwarded intact."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_wsync.bench._storeproxy import CountingProxy, ProtocolError, parse_request


@pytest.mark.timeout(60)
def test_counts_every_command_a_client_sends() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    with CountingProxy("127.0.0.1", server.port) as proxy:
        client = dist.TCPStore("127.0.0.1", proxy.port, is_master=False, timeout=timedelta(seconds=10))
        assert proxy.snapshot() == {"validate": 1, "ping": 1}
        for i in range(50):
            client.set(f"k{i}", "v" * i)
        assert client.compare_set("k3", "vvv", "w" * 70000) == b"w" * 70000  # spans several reads
        assert client.get("k3") == b"w" * 70000  # a wait for the key, then the get
        assert client.add("n", 5) == 5
        assert client.check(["k1", "k2"])
        assert client.multi_get(["k1", "k2"]) == [b"v", b"vv"]
        client.multi_set(["a", "b"], ["1", "22"])
        assert client.delete_key("a")
        with pytest.raises(dist.DistStoreError):
            client.wait(["never"], timedelta(seconds=0.2))  # a wait, then its cancel
        assert client.num_keys() >= 50
        counts = proxy.snapshot()
        assert proxy.unparsed == 0
        assert counts == {"validate": 1, "ping": 1, "set": 50, "compare_set": 1, "wait": 3, "get": 1, "add": 1,
                          "check": 1, "multi_get": 1, "multi_set": 1, "delete_key": 1, "cancel_wait": 1,
                          "num_keys": 1}  # fmt: skip
        assert server.get("k49") == b"v" * 49 and server.get("b") == b"22"
        del client


def test_parser_waits_for_a_whole_request_and_refuses_unknown_bytes() -> None:
    frame = bytes([1]) + (2).to_bytes(8, "little") + b"/k" + (1).to_bytes(8, "little") + b"v"
    assert parse_request(frame, 0) == ("set", len(frame))
    assert all(parse_request(frame[:cut], 0) is None for cut in range(len(frame)))
    with pytest.raises(ProtocolError, match="unknown TCPStore command byte 200"):
        parse_request(bytes([200]), 0)
