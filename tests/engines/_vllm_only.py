"""Imported first by the real-engine tests: skips them where vLLM is not installed
(``bash .ci/vllm_venv.sh`` builds ``.venv-vllm`` for them) and puts the LLM example's
helpers (``tiny_llama``, ``task``) on the path.

``PROCESSES``: the mark of every test that starts vLLM processes (servers, a multi-process or
tensor-parallel engine, the demo). ``pytest -n 2 --dist loadgroup`` (as ``.ci/run`` runs this
folder) runs them one after another in one worker, the other tests beside them in the other:
vLLM binds each such engine's worker to a core (``auto``: core 0; the server pairs and TP=2
engines: 0 and 1), and two engines whose workers share a core starve each other
(``_vllm_server``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed: pip install 'lightning-wsync[vllm]' (.ci/run: .venv-vllm)")
pytest.importorskip("transformers", reason="transformers comes with vLLM")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llm_vllm"
sys.path.insert(0, str(EXAMPLE))

PROCESSES = pytest.mark.xdist_group("vllm-processes")
