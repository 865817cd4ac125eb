"""Imported first by the real-engine tests: skips them where vLLM is not installed
(``bash .ci/vllm_venv.sh`` builds ``.venv-vllm`` for them) and puts the LLM example's
helpers (``tiny_llama``, ``task``) on the path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed: pip install 'lightning-wsync[vllm]' (.ci/run: .venv-vllm)")
pytest.importorskip("transformers", reason="transformers comes with vLLM")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llm_vllm"
sys.path.insert(0, str(EXAMPLE))
