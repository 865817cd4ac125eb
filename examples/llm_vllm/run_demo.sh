#!/usr/bin/env bash
# The LLM actor-learner demo, end to end, as a new user would run it:
#   bash examples/llm_vllm/run_demo.sh
# Installs what it needs into .venv-vllm (torch==2.13.0 first, then this project with its
# vllm and demo extras: .ci/vllm_venv.sh), writes a tiny random Llama with a locally
# trained tokenizer, then runs a vLLM engine (rollout.py) and a Lightning trainer
# (train.py) as two processes on one store: the engine samples, the trainer learns by
# policy gradient and pushes every N steps, the engine reloads between generate calls.
# Plots reward against version and exits 0 once the reward target is reached.
# --tp 2 runs the engine tensor-parallel on two worker processes; --async runs it as an
# AsyncLLM with requests streaming through updates (rollout_async.py). Other arguments go
# to train.py (e.g. --every-n-steps 4 --target 0.8).
set -euo pipefail
rollout_args=() train_args=() bind=nobind
while [ $# -gt 0 ]; do
    case "$1" in
        --tp) rollout_args+=(--tp "$2"); [ "$2" -gt 1 ] && bind="0|1"; shift 2 ;;
        --async) rollout_args+=(--async); shift ;;
        *) train_args+=("$1"); shift ;;
    esac
done
cd "$(dirname "$0")/../.."
root=$(pwd)

venv=${WSYNC_VLLM_VENV:-.venv-vllm}
py=$venv/bin/python
if ! "$py" -c "import lightning_wsync, vllm, transformers, matplotlib" 2>/dev/null; then
    echo "== installing into $venv (torch==2.13.0, then lightning-wsync[vllm,demo]; ~3 min, ~3.5 GB)"
    bash .ci/vllm_venv.sh "$venv"
fi

out=${WSYNC_DEMO_OUT:-$root/wsync_llm_out}
rm -rf "$out" && mkdir -p "$out"
port=$("$py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
export WSYNC_STORE="127.0.0.1:$port" WSYNC_JOB="llm-$$"
# One core each on a 2-core machine: vLLM's OpenMP threads are not pinned, torch uses one.
# With --tp 2 the two workers are pinned one to each core.
export OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=$bind VLLM_ENABLE_V1_MULTIPROCESSING=0

pids=()
cleanup() { for pid in "${pids[@]}"; do kill -- -"$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

echo "== model:   $out/model (2 layers, hidden 128, vocab 512, random)"
"$py" -c "import sys; sys.path.insert(0, 'examples/llm_vllm'); from tiny_llama import write_tiny_llama; write_tiny_llama('$out/model')" \
    >"$out/model.log" 2>&1
echo "== rollout: python examples/llm_vllm/rollout.py ${rollout_args[*]} (vLLM engine, store $WSYNC_STORE, job $WSYNC_JOB)"
echo "== trainer: python examples/llm_vllm/train.py ${train_args[*]}"
setsid "$py" examples/llm_vllm/rollout.py "$out/model" "$out" "${rollout_args[@]}" >"$out/rollout.log" 2>&1 &
rollout=$!; pids+=("$rollout")
trainer_rc=0
"$py" examples/llm_vllm/train.py "$out/model" "$out" "${train_args[@]}" 2>&1 | tee "$out/trainer.log" \
    | grep --line-buffered -E '^\[trainer' || trainer_rc=${PIPESTATUS[0]}
rollout_rc=0; wait "$rollout" || rollout_rc=$?

grep -h -E '^\[rollout' "$out/rollout.log" || true
plot=$("$py" examples/llm_vllm/plot.py "$out")
echo "== trainer exited $trainer_rc, rollout exited $rollout_rc"
echo "== plot: $plot"
"$py" - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
s = json.loads((out / "summary.json").read_text())
rows = [json.loads(l) for l in (out / "rollout.jsonl").read_text().splitlines() if l]
first = [r["reward"] for r in rows if r["version"] == 0]
reloads = sorted(r["reload_s"] for r in rows if r["reload_s"] is not None)
pauses = sorted(p for r in rows for p in (r.get("paused_s") or []))  # --async: updates land between batches
if reloads:
    what, times = "update (reload + prefix-cache reset)", reloads
else:
    what, times = "pause per update (stage outside it; load + prefix-cache reset inside)", pauses
median = f"{times[len(times) // 2] * 1e3:.0f} ms" if times else "-"
print(f"== engine reward at version 0: {sum(first) / max(1, len(first)):.3f}; "
      f"median engine {what} {median} over {len(times)} updates")
print(f"== {'SOLVED' if s['solved'] else 'NOT SOLVED'}: mean reward of the last batches {s['final_mean_reward']:.3f} "
      f"(target {s['target_reward']:g}) after {s['versions']} trainer steps, {s['batches']} batches"
      + (f", {s['seconds']:.1f} s" if s['solved'] else ""))
sys.exit(0 if s["solved"] else 1)
PY
[ "$trainer_rc" -eq 0 ] && [ "$rollout_rc" -eq 0 ]
