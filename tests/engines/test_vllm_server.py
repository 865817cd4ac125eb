"""``vllm serve`` with no code of ours, driven by vLLM's own trainer API.

Two real vLLM OpenAI servers (CPU) start with only ``--weight-transfer-config
'{"backend": "wsync"}'`` of ours on their command lines (the backend comes from the
``vllm.general_plugins`` entry point). A trainer written against vLLM's API
(``WeightTransferTrainerFactory``, ``ModuleSource``, ``HTTPVLLMWeightSyncClient``) pushes
versions; after each, ``/weight_info`` reports it and greedy ``/v1/completions`` equal
transformers at that version, and requests streaming through the updates carry vLLM's
per-token labels, replayed token by token at the version each names. The servers take
~1-2 min to start on a loaded 2-core machine, so one pair serves the whole module.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import _vllm_only  # first: skips without vLLM
import pytest
import requests
import torch
from _vllm_server import Server
from conftest import free_port
from test_vllm_async import replay
from test_vllm_engine import NEW_TOKENS, PROMPTS, hf_greedy, perturb
from tiny_llama import write_tiny_llama

from lightning_wsync.engines.vllm_async import VersionedOutput
from lightning_wsync.errors import WeightSyncError

# The first test also waits for the servers.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500), _vllm_only.PROCESSES]

STREAM_TOKENS = 24
START_S = 600  # both servers start at once; on two shared cores that can take minutes
SPAN_VERSIONS = 8
"""Versions pushed past a test's own, at most, until a streamed request spans an update: where
an update lands within a request is chance (one CI run of 4 updates had none land mid-request)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model"), init_std=0.5)


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    # The receivers' INFO lines in the servers' logs: a failure shows what each server's receiver did.
    started = [Server(model_dir, free_port(), logs / f"server{i}.log", cpus=str(i),
                      extra_env={"WSYNC_LOG_LEVEL": "INFO"}) for i in range(2)]  # fmt: skip
    try:
        for s in started:
            s.wait_ready(START_S)
        yield started
    finally:
        for s in started:
            s.stop()


def trainer_and_prompt(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)(PROMPTS[0]).input_ids


def start_engine(model, urls, job, **server_options):
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from lightning_wsync.engines.vllm_trainer import WsyncClients, WsyncTrainerInitInfo

    clients = [HTTPVLLMWeightSyncClient(u, timeout=120) for u in urls]
    info = WsyncTrainerInitInfo(store=f"127.0.0.1:{free_port()}", job=job, rank=0, timeout_s=60,
                                server_options=server_options)  # fmt: skip
    client = clients[0] if len(clients) == 1 else WsyncClients(clients)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))


def test_a_trainer_on_vllms_api_pushes_versions_that_a_plain_server_serves(servers, model_dir):
    server = servers[0]
    assert server.weight_version() == "default"
    model, ids = trainer_and_prompt(model_dir)
    reference = trainer_and_prompt(model_dir)[0]
    engine = start_engine(model, [server.url], "one", verify=True)
    weights: dict[int, dict[str, torch.Tensor]] = {}
    streamed: list[tuple[list[int], list[tuple[int, str]]]] = []
    streaming = threading.Event()

    def client() -> None:  # requests run through every update; each token says which version made it
        while not streaming.is_set():
            streamed.append(server.generate(ids, STREAM_TOKENS))

    stream = threading.Thread(target=client, name="test-stream", daemon=True)
    try:
        seen = []
        for version in range(6 + SPAN_VERSIONS):
            if version >= 6 and spanned(streamed):
                break
            next_weights(model, weights, version, distinct=6)
            engine.send_weights()
            expected, gap = hf_greedy(model, ids)
            assert gap > 1e-4, "near-tie in the reference; pick another seed"
            assert server.weight_version() == str(version) == str(engine.version)
            assert server.complete(ids, NEW_TOKENS) == expected, f"version {version}"
            assert server.generate(ids, NEW_TOKENS) == (expected, [(0, str(version))])
            seen.append(expected)
            if version == 0:
                stream.start()
        assert len({tuple(s) for s in seen[:6]}) == 6  # every version answered differently
    finally:
        streaming.set()
        if stream.is_alive():
            stream.join(120)
        engine.shutdown()
    replay_streamed(reference, weights, ids, streamed)


def next_weights(model, weights: dict[int, dict[str, torch.Tensor]], version: int, distinct: int) -> None:
    """``version``'s weights into ``model`` and ``weights``: a new perturbation for each of the first
    ``distinct`` versions, past those the weights of versions 1, 2, ... again (greedy answers
    already checked for near-ties), so a version pushed only to get a request across an update
    brings no new tie."""
    if version >= distinct:
        model.load_state_dict(weights[1 + (version - distinct) % (distinct - 1)])
    elif version:
        perturb(model, version)
    weights[version] = {k: v.clone() for k, v in model.state_dict().items()}


def spanned(streamed: list[tuple[list[int], list[tuple[int, str]]]]) -> bool:
    """Whether a streamed request so far spans an update (its tokens carry two labels)."""
    return any(len(labels) > 1 for _, labels in list(streamed))


def replay_streamed(reference, weights, ids, streamed: list[tuple[list[int], list[tuple[int, str]]]]) -> None:
    """Every streamed request that spans an update, and a sample of the others, replayed token
    by token at the version its label names (KV kept across a switch)."""
    switched = [labels for _, labels in streamed if len(labels) > 1]
    assert switched, "no streamed request spanned an update"
    single = [(t, labels) for t, labels in streamed if len(labels) == 1]
    for tokens, labels in [*single[:: max(1, len(single) // 6)], *[r for r in streamed if len(r[1]) > 1]]:
        switches = [(start, int(label)) for start, label in labels]
        replay(reference, weights, ids, VersionedOutput(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens)]),
                                                        switches[0][1], switches[1:]))  # fmt: skip


def test_two_servers_with_fleet_report_the_same_version_after_every_push(servers, model_dir):
    model, ids = trainer_and_prompt(model_dir)
    engine = start_engine(model, [s.url for s in servers], "pair", fleet="rollout")
    try:
        for version in range(5):
            if version:
                perturb(model, 10 + version)
            engine.send_weights()
            expected, _ = hf_greedy(model, ids)
            assert [s.weight_version() for s in servers] == [str(version)] * 2
            assert [s.complete(ids, NEW_TOKENS) for s in servers] == [expected] * 2, f"version {version}"
    except BaseException:
        for s in servers:  # shown with the failure: what each server's receiver did
            print(f"--- {s.url}: lightning_wsync's lines\n{s.wsync_lines()}")
        raise
    finally:
        engine.shutdown()


def test_a_name_the_model_would_not_load_is_refused_and_the_server_keeps_its_version(servers, model_dir):
    server = servers[0]
    model, ids = trainer_and_prompt(model_dir)
    engine = start_engine(model, [server.url], "names")
    try:
        engine.send_weights()
        assert server.weight_version() == "0"
        kept = server.complete(ids, NEW_TOKENS)
    finally:
        engine.shutdown()
    model.model.layers[0].mlp.extra_scale = torch.nn.Parameter(torch.ones(4))  # vLLM's Llama has none
    engine = start_engine(model, [server.url], "names-bad")
    try:
        with pytest.raises((requests.HTTPError, WeightSyncError)):
            engine.send_weights()
        assert server.weight_version() == "0"
        assert server.complete(ids, NEW_TOKENS) == kept
    finally:
        engine.shutdown()


class Policy(__import__("lightning").pytorch.LightningModule):
    """The tiny Llama under a Lightning module; a loss that moves every weight a little per step."""

    def __init__(self, model):
        super().__init__()
        self.policy = model

    def training_step(self, batch, batch_idx):
        return self.policy(input_ids=batch[0]).logits.float().pow(2).mean() * 1e3

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_lightning_trainer_drives_the_servers_through_its_callbacks(servers, model_dir):
    import lightning.pytorch as pl

    from lightning_wsync import WeightSyncCallback
    from lightning_wsync.engines.vllm_callback import VllmServersCallback

    model, ids = trainer_and_prompt(model_dir)
    sync = WeightSyncCallback(every_n_steps=1, module="policy", store=f"127.0.0.1:{free_port()}", job="lightning",
                              timeout_s=60)  # fmt: skip
    follow = VllmServersCallback(sync, [s.url for s in servers], timeout_s=60)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor([ids] * 3)), batch_size=1)
    trainer = pl.Trainer(max_steps=3, callbacks=[sync, follow], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")  # fmt: skip
    trainer.fit(Policy(model), data)
    assert follow.version == sync.last_pushed_version == 3
    expected, _ = hf_greedy(model.eval(), ids)
    assert [s.weight_version() for s in servers] == ["3", "3"]
    assert [s.complete(ids, NEW_TOKENS) for s in servers] == [expected] * 2
