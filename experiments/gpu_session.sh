#!/usr/bin/env bash
# One call on the lent GPU machine, everything the performance issue asks for measured in one
# run (about 6-7 minutes on one H200; every step has its own timeout):
#   1. kernel checks: jnp and Pallas against the float64 reference; which one `auto` runs
#   2. `loco-jax bench`: compress kernel and loco().update on 2**30 against adamw and a copy,
#      the GPT-2-shaped tree (148 leaves) local step and compile, wire bits (HLO, 8 host CPUs)
#   3. experiments/gpu_mesh_check.py: the bucketed mesh step runs the Pallas kernels and the
#      receive-side mean; the GPT-2-shaped tree's mesh step (compile, step) against fp32 pmean
#   4. ncu on the compress kernel and the mean (occupancy, registers, memory throughput), if
#      ncu is installed and allowed
# The log and bench-gpu.json land in $OUT (runs/gpu-session without OUT).
#
#   device run: bash experiments/gpu_session.sh        (timeout_s 540)
set -u -o pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu-session}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

exec > >(tee "$OUT/session.log") 2>&1  # at most 8 files come back: one log holds it all
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
"$PY" -c "import jax, sys; print('jax', jax.__version__, 'python', sys.version.split()[0], jax.devices())"
echo "git $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
started=$(date +%s)
status=0
step() {  # step NAME TIMEOUT COMMAND...: runs it, says how long it took, keeps the worst status
  local name=$1 limit=$2; shift 2
  echo; echo "== $name"
  timeout "$limit" "$@"; local rc=$?
  echo "$name: status $rc, $(( $(date +%s) - started )) s in all"
  [ "$rc" -ne 0 ] && status=1
  return 0
}

step "1/4 kernel checks (float64 reference)" 120 "$PY" -m loco_jax bench --check-kernels
step "2/4 bench" 240 "$PY" -m loco_jax bench --skip codec --json "$OUT/bench-gpu.json"
step "3/4 mesh step on one GPU" 120 "$PY" experiments/gpu_mesh_check.py
if command -v ncu >/dev/null 2>&1; then
  step "4/4 ncu: compress kernel and mean" 120 ncu --kernel-name regex:loco_ --launch-skip 2 \
    --launch-count 2 --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section MemoryWorkloadAnalysis "$PY" experiments/gpu_ncu_target.py
else
  echo; echo "== 4/4 ncu: not installed here (skipped)"
fi
echo; echo "gpu_session: status $status, $(( $(date +%s) - started )) s"
exit "$status"
