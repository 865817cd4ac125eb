#!/usr/bin/env bash
# The CartPole actor-learner demo, end to end, as a new user would run it:
#   bash examples/cartpole/run_demo.sh
# Installs what it needs into .venv (torch==2.13.0 first, then this project with its
# demo extra), launches the trainer and the rollout torchrun jobs on 127.0.0.1 with
# --rdzv-backend=wsync, prints progress, plots return against version and time, and
# exits 0 once the rollout return reached the target (non-zero otherwise).
# Extra arguments go to the trainer app as Hydra overrides (e.g. wsync.every_n_steps=4).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)

py=.venv/bin/python
if ! "$py" -c "import lightning_wsync, gymnasium, matplotlib" 2>/dev/null; then
    echo "== installing into .venv (torch==2.13.0, then lightning-wsync[demo])"
    [ -x "$py" ] || python3 -m venv .venv
    "$py" -m pip install -q --upgrade pip
    "$py" -m pip install -q torch==2.13.0
    "$py" -m pip install -q -e ".[demo]"
fi

out=${WSYNC_DEMO_OUT:-$root/wsync_demo_out}
rm -rf "$out" && mkdir -p "$out"
export WSYNC_DEMO_OUT=$out
port=$("$py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
job="cartpole-$$"
rdzv=(--rdzv-backend=wsync --rdzv-endpoint="127.0.0.1:$port" --rdzv-id="$job" --monitor-interval=0.5)

pids=()
cleanup() { for pid in "${pids[@]}"; do kill -- -"$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

echo "== trainer job:  torchrun --nnodes=1 --nproc-per-node=1 ${rdzv[*]} --rdzv-conf role=trainer examples/cartpole/train.py"
echo "== rollout job:  torchrun --nnodes=1:2 --nproc-per-node=2 ${rdzv[*]} --rdzv-conf role=rollout examples/cartpole/rollout.py"
echo "== logs and plot in $out"
setsid .venv/bin/torchrun --nnodes=1:2 --nproc-per-node=2 --max-restarts=3 "${rdzv[@]}" --rdzv-conf role=rollout \
    examples/cartpole/rollout.py >"$out/rollout.log" 2>&1 &
rollout=$!; pids+=("$rollout")
# The trainer job in the foreground; its progress lines on the terminal, everything in the log.
trainer_rc=0
.venv/bin/torchrun --nnodes=1 --nproc-per-node=1 "${rdzv[@]}" --rdzv-conf role=trainer \
    examples/cartpole/train.py "$@" 2>&1 | tee "$out/trainer.log" | grep --line-buffered -E '^\[trainer' \
    || trainer_rc=${PIPESTATUS[0]}
rollout_rc=0; wait "$rollout" || rollout_rc=$?

grep -h -E '^\[rollout' "$out/rollout.log" || true
plot=$("$py" examples/cartpole/plot.py "$out")
echo "== trainer job exited $trainer_rc, rollout job exited $rollout_rc"
echo "== plot: $plot"
"$py" - "$out/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"== {'SOLVED' if s['solved'] else 'NOT SOLVED'}: mean return of the last 20 episodes "
      f"{s['final_mean_return']:.1f} (target {s['target_return']:g}) after {s['versions']} versions, "
      f"{s['episodes']} episodes" + (f", {s['seconds']:.1f} s" if s['solved'] else ""))
sys.exit(0 if s["solved"] else 1)
PY
[ "$trainer_rc" -eq 0 ] && [ "$rollout_rc" -eq 0 ]
