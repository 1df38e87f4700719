#!/usr/bin/env bash
# One call on the lent GPU machine: gpu_bench.sh, the kernel probe, then a short larger-scale
# comparison on the GPU. The log, bench-gpu.json and the comparison land in $OUT (runs/gpu-session without OUT).
#
#   device run: bash experiments/gpu_session.sh
# Environment: COMPARE_STEPS (default 300; 0 skips the comparison), SKIP_BENCH=1.
set -u -o pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu-session}"
mkdir -p "$OUT" runs
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

exec > >(tee "$OUT/session.log") 2>&1  # at most 8 files come back: one log holds it all
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
started=$(date +%s)
if [ "${SKIP_BENCH:-0}" = 1 ]; then bench=0; else
  bash experiments/gpu_bench.sh
  bench=$?
fi
cp runs/bench-gpu.json "$OUT"/ 2>/dev/null
echo "gpu_bench: status $bench, $(( $(date +%s) - started )) s"

echo
echo "== kernel probe: rounding of XLA:GPU and Triton; compress kernel variants"
timeout 150 "${PYTHON:-python3}" experiments/gpu_kernel_probe.py
echo "probe: status $?, $(( $(date +%s) - started )) s in all"

steps="${COMPARE_STEPS:-300}"
if [ "$steps" -gt 0 ]; then
  echo
  echo "== comparison on one GPU: d_model 256, 4 layers, $steps steps"
  timeout 150 "${PYTHON:-python3}" experiments/compare.py --platform "${COMPARE_PLATFORM:-gpu}" \
    --devices 1 --d-model 256 --layers 4 --steps "$steps" --variants none,ef4,noef4,loco4 \
    --seeds 0 --out "$OUT/compare-gpu"
  echo "compare: status $?, $(( $(date +%s) - started )) s in all"
  rm -rf "$OUT/compare-gpu/xla-cache"  # hundreds of files: they would not come back anyway
fi
exit "$bench"
