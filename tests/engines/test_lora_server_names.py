"""ServedAdapterNames against a recording HTTP server (no vLLM): which names are served, and in
what order they are unloaded, updated and loaded around each version."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lightning_wsync.engines.vllm_lora_servers import ServedAdapterNames
from lightning_wsync.engines.vllm_servers import VllmServers
from lightning_wsync.errors import WeightSyncError

pytestmark = pytest.mark.timeout(60)


class Recorder(BaseHTTPRequestHandler):
    calls: list[tuple[str, object]] = []
    missing: set[str] = set()  # adapter names the fake server does not know

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        route = self.path.lstrip("/").split("?")[0]
        Recorder.calls.append((route, body))
        if route == "v1/unload_lora_adapter" and body["lora_name"] in Recorder.missing:
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "cannot be found"}}')
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'"ok"' if route.startswith("v1/") else b'{"success": true}')

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_server():
    Recorder.calls, Recorder.missing = [], set()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=httpd.serve_forever, name="test-fake-vllm", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        thread.join(10)


def adapter_calls() -> list[tuple[str, object]]:
    keep = ("v1/", "update_weights")
    return [
        (r, b)
        for r, b in Recorder.calls
        if r.startswith(keep) and (r != "update_weights" or b["update_info"].get("stage_only"))
    ]


def test_each_version_unloads_the_names_it_pushes_out_first_and_is_served_last(fake_server):
    servers = VllmServers([fake_server], timeout_s=10)
    names = ServedAdapterNames(servers, keep=2)
    Recorder.missing = {"wsync-v0"}  # unloaded by hand already: a 404 there is no error
    for version in range(4):
        names.apply(servers, version, timeout_s=5)
    stage = lambda v: ("update_weights", {"update_info": {"version": v, "timeout_s": 5, "stage_only": True}})  # noqa: E731
    load = lambda v: ("v1/load_lora_adapter", {"lora_name": f"wsync-v{v}", "lora_path": f"wsync:v{v}"})  # noqa: E731
    unload = lambda v: ("v1/unload_lora_adapter", {"lora_name": f"wsync-v{v}"})  # noqa: E731
    assert adapter_calls() == [stage(0), load(0), stage(1), load(1), unload(0), stage(2), load(2),
                               unload(1), stage(3), load(3)]  # fmt: skip
    assert names.versions == [2, 3]


def test_options_and_refusals(fake_server):
    servers = VllmServers([fake_server], timeout_s=10)
    assert ServedAdapterNames.from_options(servers, {"verify": True}) is None
    with pytest.raises(ValueError, match=r"'lora' on servers needs 'keep_adapters' too"):
        ServedAdapterNames.from_options(servers, {"lora": {"r": 8}})
    with pytest.raises(ValueError, match=r"keep=0 must be an int >= 1"):
        ServedAdapterNames(servers, keep=0)
    names = ServedAdapterNames.from_options(servers, {"lora": {"r": 8}, "keep_adapters": 1})
    assert names is not None and names.keep == 1
    down = ServedAdapterNames(VllmServers(["http://127.0.0.1:9"], timeout_s=2), keep=1)
    with pytest.raises(WeightSyncError, match=r"POST /start_weight_update failed \(.*refused"):
        down.apply(down.servers, 0, timeout_s=1)
