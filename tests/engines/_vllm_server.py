"""Real vLLM OpenAI servers for the tests: started as a user would, stopped by process group.

The command line is vLLM's own plus ``--weight-transfer-config '{"backend": "wsync"}'``;
the ``wsync`` backend comes from our ``vllm.general_plugins`` entry point, and the RL
routes from ``VLLM_SERVER_DEV_MODE=1`` (vLLM registers them only then). ``--enable-scale-out``
(vLLM's) serves ``/inference/v1/generate``, whose outputs carry per-token weight labels.

Two servers on one host get a core each (``cpus``): left to itself, vLLM binds every CPU
server's worker to core 0 (``VLLM_CPU_OMP_THREADS_BIND=auto`` reserves the other core for
its engine process), and with one server busy the other's engine and worker then lose the
wake-ups of vLLM's shared-memory queue and wait out its 5 s re-check, message after message
(docs/engines.md, "Several CPU servers on one host").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import requests


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process group."""

    def __init__(self, model: Path, port: int, log: Path, extra_env: dict[str, str] | None = None,
                 args: Sequence[str] = (), cpus: str | None = None) -> None:  # fmt: skip
        self.model, self.url, self.log = str(model), f"http://127.0.0.1:{port}", log
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
               "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0", "--enable-scale-out",
               "--weight-transfer-config", '{"backend": "wsync"}', *args]  # fmt: skip
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(extra_env or {})}
        if cpus is not None:  # vLLM binds every CPU server's worker to the same cores unless told
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).ok:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM server not up within {timeout_s} s: {self.log.read_text()[-3000:]}")

    def weight_version(self, timeout_s: float = 30.0) -> str:
        response = requests.get(f"{self.url}/weight_info", timeout=timeout_s)
        response.raise_for_status()
        return str(response.json()["weight_version"])

    def complete(self, prompt_ids: list[int], tokens: int, model: str | None = None) -> list[int]:
        body = {"model": model or self.model, "prompt": prompt_ids, "max_tokens": tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        response = requests.post(f"{self.url}/v1/completions", json=body, timeout=60)
        response.raise_for_status()
        return list(response.json()["choices"][0]["token_ids"])

    def generate(self, prompt_ids: list[int], tokens: int) -> tuple[list[int], list[tuple[int, str]]]:
        """``/inference/v1/generate`` (vLLM's tokens-in endpoint, ``--enable-scale-out``): the
        tokens, and ``(start, label)`` of each span of vLLM's per-token weight-version labels."""
        body = {"token_ids": prompt_ids, "sampling_params": {"temperature": 0.0, "max_tokens": tokens,
                                                             "ignore_eos": True}}  # fmt: skip
        response = requests.post(f"{self.url}/inference/v1/generate", json=body, timeout=120)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        return list(choice["token_ids"]), [(s["start"], s["version"]) for s in choice["weight_versions"]]

    def log_tail(self, lines: int = 40) -> str:
        """The server log's last ``lines`` lines but for its per-request access lines."""
        text = self.log.read_text(errors="replace").splitlines()
        kept = [line for line in text if not line.startswith("INFO:") or "generate" not in line]
        return "\n".join(kept[-lines:])

    def wsync_lines(self, lines: int = 60) -> str:
        """The last ``lines`` of lightning_wsync's own log lines (``WSYNC_LOG_LEVEL`` in ``extra_env``)."""
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join([line for line in text if " wsync[" in line or "lightning_wsync" in line][-lines:])

    def stop(self) -> None:
        """SIGTERM to the server's process group (API server, engine core, workers), SIGKILL after 20 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group's other members, if any are left
        except ProcessLookupError:
            pass
        self.proc.wait(10)
