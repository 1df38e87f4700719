#!/usr/bin/env bash
# The whole GPU benchmark in one go (under 5 minutes on one H200); installs nothing.
#
#   experiments/gpu_bench.sh                      # from anywhere; runs in the repository root
#   PYTHON=/opt/venv/bin/python experiments/gpu_bench.sh
#
# 1. `loco-jax bench --check-kernels`: the jnp path and the Pallas (Triton) kernels against the
#    float64 reference (compress step and dequantize_mean), and what `auto` runs, on the GPU.
# 2. `loco-jax bench --json runs/bench-gpu.json`: LoCo's step on 2**30 float32 against
#    optax.adamw and a device copy, the Pallas tile sweep, wire bits (8 host CPUs, HLO), the
#    Huffman codec against zlib/zstd (host), and the cost model. The table is printed and also
#    kept in runs/bench-gpu.md, the check in runs/check-kernels-gpu.md.
# 3. experiments/codec_device_bench.py: the jnp Huffman codec against the host one.
# Exits non-zero if a step fails or a check does not pass (after running both).
# Environment: PYTHON (default python3), BENCH_ARGS (extra bench arguments, e.g. --quick),
# REQUIRE_GPU=0 to let it run on another backend (a dry run of the script itself).
set -u -o pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p runs
export PYTHONUNBUFFERED=1

if ! "$PY" -c "import jax, optax" 2>/dev/null; then
  echo "gpu_bench: $PY cannot import jax and optax; set PYTHON to an interpreter that can" >&2
  exit 2
fi
backend=$("$PY" -c "import jax; print(jax.default_backend())") || exit 2
"$PY" -c "import jax, sys; print('jax', jax.__version__, 'python', sys.version.split()[0], \
  jax.devices())"
echo "git $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
if [ "$backend" != "gpu" ] && [ "${REQUIRE_GPU:-1}" != "0" ]; then
  echo "gpu_bench: the default backend is $backend, not gpu (REQUIRE_GPU=0 runs it anyway)" >&2
  exit 2
fi

status=0
echo
echo "== 1/3 kernel checks"
timeout 120 "$PY" -m loco_jax bench --check-kernels | tee runs/check-kernels-gpu.md
check=$?
[ "$check" -ne 0 ] && { echo "gpu_bench: kernel checks failed (status $check)" >&2; status=1; }

echo
echo "== 2/3 benchmark"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words on purpose
timeout 240 "$PY" -m loco_jax bench --json runs/bench-gpu.json ${BENCH_ARGS:-} \
  | tee runs/bench-gpu.md
bench=$?
[ "$bench" -ne 0 ] && { echo "gpu_bench: benchmark failed (status $bench)" >&2; status=1; }
[ -s runs/bench-gpu.json ] || { echo "gpu_bench: runs/bench-gpu.json was not written" >&2;
                                status=1; }

echo
echo "== 3/3 Huffman codec on the device (jnp lanes) against the host codec"
timeout 120 "$PY" experiments/codec_device_bench.py | tee runs/codec-device-gpu.md
codec=$?
[ "$codec" -ne 0 ] && { echo "gpu_bench: codec bench failed (status $codec)" >&2; status=1; }

echo
[ "$status" -eq 0 ] && echo "gpu_bench: done; records in runs/bench-gpu.json" \
                    || echo "gpu_bench: FAILED" >&2
exit "$status"
