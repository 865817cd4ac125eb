"""vLLM servers that follow the trainer on their own (``WSYNC_FOLLOW=1``), no client calls.

Two real vLLM OpenAI servers (CPU) start with only ``--weight-transfer-config '{"backend":
"wsync"}'`` of ours on their command lines and ``WSYNC_FOLLOW=1``, ``WSYNC_STORE``,
``WSYNC_JOB``, ``WSYNC_FOLLOW_OPTIONS='{"fleet": ...}'`` in their environment. A plain
trainer pushes five versions (and more, earlier weights again, until a streamed request has
spanned an update) and calls no server: after each, both servers come to report
it in ``/weight_info`` and greedy ``/v1/completions`` equal transformers at that version;
a client streaming through the updates gets vLLM's per-token labels, and every request
that spans an update is replayed token by token at the versions its labels name. Each
server has a core of its own, as two servers on one host are deployed (``_vllm_server``).
"""

from __future__ import annotations

import json
import threading
import time

import _vllm_only  # first: skips without vLLM
import pytest
import torch
from _vllm_server import Server
from conftest import free_port
from test_vllm_engine import NEW_TOKENS, PROMPTS, hf_greedy
from test_vllm_server import SPAN_VERSIONS, next_weights, replay_streamed, spanned
from tiny_llama import write_tiny_llama

from lightning_wsync import WeightSender
from lightning_wsync.engines._worker.follow import follow_settings

STREAM_TOKENS = 24
START_S = 600  # both servers start at once; on two shared cores that can take minutes
FOLLOW_S = 120  # bound on a server applying a pushed version on its own


def test_follow_settings_from_the_environment_and_the_servers_command_line():
    assert follow_settings({}, []) is None
    assert follow_settings({"WSYNC_FOLLOW": "0"}, []) is None
    argv = ["api_server.py", "--model", "m", "--host", "0.0.0.0", "--port", "8123"]
    assert follow_settings({"WSYNC_FOLLOW": "1"}, argv).url == "http://127.0.0.1:8123"
    assert follow_settings({"WSYNC_FOLLOW": "true"}, ["vllm", "serve", "m", "--port=9001"]).url == (
        "http://127.0.0.1:9001"
    )
    assert follow_settings({"WSYNC_FOLLOW": "1"}, ["vllm", "serve", "m"]).url == "http://127.0.0.1:8000"
    settings = follow_settings(
        {"WSYNC_FOLLOW": "http://10.0.0.5:8000/", "WSYNC_FOLLOW_OPTIONS": '{"fleet": "r", "timeout_s": 30}'}, []
    )
    assert settings.url == "http://10.0.0.5:8000" and settings.options == {"fleet": "r", "timeout_s": 30}
    assert settings.timeout_s == 30.0
    with pytest.raises(ValueError, match="WSYNC_FOLLOW='maybe'"):
        follow_settings({"WSYNC_FOLLOW": "maybe"}, [])
    with pytest.raises(ValueError, match="is not JSON"):
        follow_settings({"WSYNC_FOLLOW": "1", "WSYNC_FOLLOW_OPTIONS": "{fleet"}, [])
    with pytest.raises(ValueError, match="JSON object"):
        follow_settings({"WSYNC_FOLLOW": "1", "WSYNC_FOLLOW_OPTIONS": "[1]"}, [])
    with pytest.raises(ValueError, match="WSYNC_FOLLOW_OPTIONS: unexpected keyword argument 'flet'"):
        follow_settings({"WSYNC_FOLLOW": "1", "WSYNC_FOLLOW_OPTIONS": '{"flet": "r"}'}, [])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model"), init_std=0.5)


def await_versions(servers: list[Server], version: int, seen: list[tuple[str, ...]]) -> None:
    """Until every server reports ``version`` (each observation kept in ``seen``)."""
    deadline = time.monotonic() + FOLLOW_S
    while True:
        # /weight_info is answered by the engine core's loop: each read may take what is left
        # of FOLLOW_S, the bound this test sets, and a failure prints both servers' logs.
        now = tuple(s.weight_version(max(5.0, deadline - time.monotonic())) for s in servers)
        seen.append(now)
        if now == (str(version),) * len(servers):
            return
        assert time.monotonic() < deadline, f"servers did not follow to version {version}: {seen[-5:]}"
        time.sleep(0.2)  # polling an observable: /weight_info, bounded by the deadline above


@pytest.mark.slow
@pytest.mark.timeout(1500)
@_vllm_only.PROCESSES
@pytest.mark.parametrize("options", [pytest.param({}, id="plain"), pytest.param({"fleet": "pair"}, id="fleet")])
def test_two_following_servers_serve_each_pushed_version_with_no_client_calls(model_dir, tmp_path, options):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(model_dir)(PROMPTS[0]).input_ids
    store, job = f"127.0.0.1:{free_port()}", "follow"
    env = {"WSYNC_FOLLOW": "1", "WSYNC_STORE": store, "WSYNC_JOB": job,
           "WSYNC_FOLLOW_OPTIONS": json.dumps({**options, "timeout_s": 60, "verify": True})}  # fmt: skip
    weights: dict[int, dict[str, torch.Tensor]] = {}
    streamed: list[tuple[list[int], list[tuple[int, str]]]] = []
    streaming = threading.Event()
    with WeightSender(model, store=store, job=job, timeout_s=60) as sender:
        servers = [Server(model_dir, free_port(), tmp_path / f"server{i}.log", env, cpus=str(i)) for i in range(2)]

        def client() -> None:  # requests run through every update; each token says which version made it
            while not streaming.is_set():
                streamed.append(servers[0].generate(ids, STREAM_TOKENS))

        stream = threading.Thread(target=client, name="test-stream", daemon=True)
        try:
            for s in servers:
                s.wait_ready(START_S)
            assert [s.weight_version() for s in servers] == ["default", "default"]
            seen: list[tuple[str, ...]] = []
            answers = []
            for version in range(5 + SPAN_VERSIONS):
                if version >= 5 and spanned(streamed):
                    break
                next_weights(model, weights, version, distinct=5)
                sender.push(version)  # nothing else: no server route is called from here
                expected, gap = hf_greedy(model, ids)
                assert gap > 1e-4, "near-tie in the reference; pick another seed"
                await_versions(servers, version, seen)
                assert [s.complete(ids, NEW_TOKENS) for s in servers] == [expected] * 2, f"version {version}"
                assert [s.generate(ids, NEW_TOKENS) for s in servers] == [(expected, [(0, str(version))])] * 2
                answers.append(expected)
                if version == 0:
                    stream.start()
            assert len({tuple(a) for a in answers[:5]}) == 5  # every version answered differently
            # Each server goes through the pushed versions in order; the two differ only while
            # one has applied the newest and the other not yet (they apply independently).
            for a, b in seen:
                assert a == b or {a, b} <= {"default", *map(str, weights)}, (a, b)
                if a != b and "default" not in (a, b):
                    assert abs(int(a) - int(b)) == 1, (a, b)
        except BaseException:
            for s in servers:  # pytest shows this on failure: what each server did last
                print(f"--- {s.url} ({s.log}) ---\n{s.log_tail()}")
            raise
        finally:
            streaming.set()
            if stream.is_alive():
                stream.join(120)
            for s in servers:
                s.stop()
    replay_streamed(reference, weights, ids, streamed)
