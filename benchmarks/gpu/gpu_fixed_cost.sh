#!/usr/bin/env bash
# Issues 12 and 19 on a GPU machine, one short run: build for sm_90; on both GEMM paths
# (CUBLAS_GUARD_GEMM_PATH=legacy, the default, and lt) the fixed-cost rows of the gpu preset (host
# and wall us per call against nn.Linear) and the host time by op (torch.profiler,
# benchmarks/investigations/profile_call.py); the per-piece breakdown at M=32, K=N=1024; then the
# fast-path and core CUDA tests for what time is left (TESTS_S). Writes under $OUT.
#   bash benchmarks/gpu/gpu_fixed_cost.sh
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."  # the repository root
OUT="${OUT:-benchmarks/results/gpu-fixed}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
timeout -k 5 220 "$PY" -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1
echo "== build rc $? ($(el))"; tail -n 3 "$OUT/build.log"
"$PY" - <<'PYEOF'
import torch, cublas_guard_ext as cg
from cublas_guard_ext import ops
print("torch", torch.__version__, "fast entry:", ops._fast_linear is not None,
      "CUDA kernels:", torch._C._dispatch_has_kernel_for_dispatch_key("cublas_guard::linear", "CUDA"))
PYEOF
# Both GEMM paths (CUBLAS_GUARD_GEMM_PATH: legacy, the default, and lt), side by side.
for gp in legacy lt; do
  CUBLAS_GUARD_GEMM_PATH=$gp timeout -s INT -k 10 60 "$PY" benchmarks/run.py --preset gpu --only fixed \
      --out "$OUT/bench-$gp" --results-md "$OUT/RESULTS-$gp.md" >"$OUT/bench-$gp.log" 2>&1
  echo "== bench $gp rc $? ($(el))"; grep -A12 "^| M | K | N | dtype" "$OUT/bench-$gp.log" | head -20
  grep -i "fixed" "$OUT/bench-$gp/targets.txt" 2>/dev/null
  CUBLAS_GUARD_GEMM_PATH=$gp timeout 60 "$PY" benchmarks/investigations/profile_call.py --device cuda \
      >"$OUT/profile-$gp.txt" 2>&1
  echo "== profile $gp rc $? ($(el)): host time by op, $OUT/profile-$gp.txt"
  grep -A8 "^====" "$OUT/profile-$gp.txt" | cut -c1-120
done
timeout 60 "$PY" benchmarks/investigations/percall_breakdown.py --device cuda --m 32 --kn 1024 --rounds 7 --calls 300 \
    >"$OUT/breakdown.txt" 2>&1
echo "== breakdown rc $? ($(el))"; cat "$OUT/breakdown.txt" | tail -n 25
timeout -s INT -k 10 ${TESTS_S:-90} "$PY" -m pytest -q -x -p no:cacheprovider tests/test_fast_path.py tests/test_cuda.py \
    tests/test_cuda_errors.py tests/test_async_record.py >"$OUT/tests.log" 2>&1
echo "== tests rc $? ($(el))"; tail -n 4 "$OUT/tests.log"
