"""``VllmServers`` and ``apply_version`` against in-process HTTP servers that record the routes (no vLLM)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from lightning_wsync import WeightReceiver, WeightSender
from lightning_wsync.engines._worker.commit import StagedVersion
from lightning_wsync.engines._worker.follow import Follower, FollowSettings
from lightning_wsync.engines.vllm_servers import VllmServers, apply_version
from lightning_wsync.errors import WeightSyncError

pytestmark = pytest.mark.timeout(30)


class Recorder(ThreadingHTTPServer):
    def __init__(self, fail_route: str | None = None) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.calls: list[tuple[str, object]] = []
        self.fail_route = fail_route
        self.thread = threading.Thread(target=self.serve_forever, name="test-http", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(5)


class Handler(BaseHTTPRequestHandler):
    server: Recorder

    def _answer(self, body: object) -> None:
        route = self.path.lstrip("/")
        self.server.calls.append((route, body))
        if route == self.server.fail_route or (
            self.server.fail_route == "load" and route == "update_weights" and not body["update_info"].get("stage_only")
        ):
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": "reload_weights raised"}')
            return
        answer = {"weight_version": "3"} if route == "weight_info" else {"success": True}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        self._answer(json.loads(self.rfile.read(length)) if length else None)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(None)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorders():
    made: list[Recorder] = []
    yield lambda fail=None: made.append(Recorder(fail)) or made[-1]
    for r in made:
        r.close()


def test_one_update_stages_while_requests_run_then_loads_and_labels_while_paused(recorders):
    a, b = recorders(), recorders()
    servers = VllmServers([a.url, b.url], timeout_s=10)
    apply_version(servers, servers, 7, timeout_s=5)
    for r in (a, b):
        assert r.calls == [
            ("start_weight_update", None),
            ("update_weights", {"update_info": {"version": 7, "timeout_s": 5, "stage_only": True}}),
            ("finish_weight_update", None),
            ("pause?mode=keep&clear_cache=false", None),
            ("start_weight_update", None),
            ("update_weights", {"update_info": {"version": 7, "timeout_s": 5}}),
            ("finish_weight_update", {"weight_version": "7"}),
            ("reset_prefix_cache", None),
            ("resume", None),
        ]
    assert servers.weight_versions() == ["3", "3"]


def test_a_failed_load_still_resumes_and_names_the_server(recorders):
    good, bad = recorders(), recorders("load")
    servers = VllmServers([good.url, bad.url], timeout_s=10)
    with pytest.raises(WeightSyncError, match=rf"{bad.url}.*update_weights answered 500.*reload_weights raised"):
        apply_version(servers, servers, 2, timeout_s=5, pause_mode="abort")
    for r in (good, bad):
        routes = [route for route, _ in r.calls]
        assert routes[3] == "pause?mode=abort&clear_cache=false" and routes[-1] == "resume"
        assert ("finish_weight_update", {"weight_version": "2"}) not in r.calls  # no label for a failed load
        assert ("update_weight_version", {"new_version": "wsync-unknown-2"}) in r.calls  # but "unknown"


def test_bad_arguments_are_refused_early():
    with pytest.raises(ValueError, match="non-empty list"):
        VllmServers("http://a:8000")
    servers = VllmServers(["http://127.0.0.1:9"], timeout_s=1)
    with pytest.raises(ValueError, match="pause_mode='wait'"):
        apply_version(servers, servers, 1, timeout_s=1, pause_mode="wait")
    with pytest.raises(WeightSyncError, match="VLLM_SERVER_DEV_MODE=1"):
        servers.weight_versions()


class FollowedEngine:
    """A worker's ``wsync`` engine as the follower sees it: a real receiver that stages versions;
    the recording server below marks a version loaded when its label is set."""

    def __init__(self, store: str, job: str, server: Recorder) -> None:
        self.store, self.job, self.server = store, job, server
        self.receiver = None
        self.staged = StagedVersion()

    @property
    def version(self) -> int | None:
        labels = [b["weight_version"] for r, b in self.server.calls if r == "finish_weight_update" and b]
        return int(labels[-1]) if labels else None

    def join_job(self, name, options) -> None:
        self.receiver = WeightReceiver(self.staged, self.store, self.job, name=name or "follower", **options)


def test_a_follower_applies_each_pushed_version_through_its_servers_routes(recorders, port, server):
    store, job = f"127.0.0.1:{port}", "follow-routes"
    model = torch.nn.Linear(4, 4)
    with WeightSender(model, store=store, job=job, timeout_s=20) as sender:
        recorder = recorders()
        engine = FollowedEngine(store, job, recorder)
        labelled = recorder.calls  # the label route marks the version loaded, as a server's load does
        follower = Follower(engine, FollowSettings(recorder.url, {"timeout_s": 10}), drive=True)
        try:
            for version in range(4):
                with torch.no_grad():
                    model.weight.add_(1.0)
                sender.push(version)
                deadline = time.monotonic() + 20
                while ("finish_weight_update", {"weight_version": str(version)}) not in labelled:
                    assert time.monotonic() < deadline, f"version {version} not applied: {recorder.calls[-5:]}"
                    time.sleep(0.05)  # polling the recorder, bounded by the deadline
                assert torch.equal(engine.staged.tensors["weight"], model.weight)
        finally:
            follower.close()
            if engine.receiver is not None:
                engine.receiver.close()
    assert follower.applied == [0, 1, 2, 3]
    routes = [(route, body) for route, body in recorder.calls if route != "health"]
    assert len(routes) == 4 * 9, routes
    for version in range(4):
        assert routes[9 * version : 9 * version + 9] == [
            ("start_weight_update", None),
            ("update_weights", {"update_info": {"version": version, "timeout_s": 10.0, "stage_only": True}}),
            ("finish_weight_update", None),
            ("pause?mode=keep&clear_cache=false", None),
            ("start_weight_update", None),
            ("update_weights", {"update_info": {"version": version, "timeout_s": 10.0}}),
            ("finish_weight_update", {"weight_version": str(version)}),
            ("reset_prefix_cache", None),
            ("resume", None),
        ]
