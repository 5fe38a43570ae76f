#!/usr/bin/env bash
# GPU memory checkers: compute-sanitizer memcheck and racecheck on a small workload that
# exercises the guard's own CUDA code -- the scan (contiguous, strided, misaligned, single- and
# multi-block sizes, the async-mode record) and the checked GEMM (forward + backward) -- and
# compares every result with torch's, so a wrong answer under the sanitizer also fails.
#
#     bash benchmarks/gpu/gpu_extra_checks.sh                  # both tools, ~90 s budget
#     bash benchmarks/gpu/gpu_extra_checks.sh --workload-only  # the workload alone, no sanitizer
#     WORKLOAD_DEVICE=cpu bash benchmarks/gpu/gpu_extra_checks.sh --workload-only   # smoke test, no GPU
#     WORKLOAD_SIZE=small ...                                  # each CUDA path once (gpu_check.sh)
#
# Called by benchmarks/gpu/gpu_check.sh with GPU_EXTRA_BUDGET_S (seconds for everything, default 90),
# OUT_EXTRA (where logs go; else $OUT/gpu_extra_checks when OUT is set, else a temp dir) and
# PYTHON (default: python, else python3). SANITIZER=/path/to/compute-sanitizer overrides the search
# (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin). TOOLS="memcheck racecheck" (initcheck, synccheck
# also work). Prints one summary line per tool, last:
#     gpu_extra_checks: memcheck: CLEAN (0 errors) in 31 s, workload OK
# Exit status: 0 = every tool ran to the end and was clean; 1 = a tool reported errors or the
# workload failed/mismatched under it; 2 = incomplete (no GPU / no CUDA build / no sanitizer /
# a tool hit the budget) with nothing found; 3 = could not run here: a probe (a 32-thread CUDA
# kernel built with nvcc, else a one-line torch program) runs without the sanitizer but not under
# it (a sandboxed device, e.g. gVisor, answers "Device not supported"), so nothing was checked.
#
# Notes: memcheck runs with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so every tensor is its own
# allocation and an out-of-bounds access is caught at the tensor's edge (with the caching
# allocator it would land silently in a neighbouring block). API errors are not reported
# (--report-api-errors no): torch's own probing calls fail on purpose; our code checks every
# return code itself. racecheck is limited to the guard's kernels (kernel name substring
# "cublas_guard") when this compute-sanitizer accepts the filter; cuBLAS's kernels are NVIDIA's.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
BUDGET_S="${GPU_EXTRA_BUDGET_S:-90}"
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
TOOLS="${TOOLS:-memcheck racecheck}"
if [ -n "${OUT_EXTRA:-}" ]; then LOG_DIR="$OUT_EXTRA"
elif [ -n "${OUT:-}" ]; then LOG_DIR="$OUT/gpu_extra_checks"
else LOG_DIR="$(mktemp -d -t gpu_extra_checks.XXXXXX)"; fi
mkdir -p "$LOG_DIR"
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }

WORKLOAD="$LOG_DIR/sanitizer_workload.py"
cat >"$WORKLOAD" <<'PYEOF'
"""The sanitizer workload: every CUDA path of the guard once, each result checked."""
import os
import sys

import torch
import torch.nn.functional as F

import cublas_guard_ext as cg

dev = os.environ.get("WORKLOAD_DEVICE", "cuda")
# WORKLOAD_SIZE=small (the GPU check's memcheck, after torch's slow start under the tool): each
# CUDA path once -- single- and multi-block, contiguous, misaligned and strided scans, every
# dtype's GEMM in each mode -- instead of every size.
SMALL = os.environ.get("WORKLOAD_SIZE") == "small"
if dev == "cuda":
    if not (torch.cuda.is_available()
            and torch._C._dispatch_has_kernel_for_dispatch_key("cublas_guard::linear", "CUDA")):
        print("WORKLOAD SKIP: no GPU or no CUDA build of the extension")
        sys.exit(3)
torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(0)
NAN, INF = float("nan"), float("inf")
checks = 0


def expect(cond, what):
    global checks
    checks += 1
    if not cond:
        print(f"WORKLOAD MISMATCH: {what}", flush=True)
        sys.exit(1)


def reference(x):
    flat = x.detach().reshape(-1)
    bad = ~torch.isfinite(flat)
    first = int(bad.nonzero()[0, 0]) if bool(bad.any()) else -1
    return (int(flat.isnan().sum()), int(flat.isposinf().sum()), int(flat.isneginf().sum()), first)


def scanned(x):
    r = cg.scan(x)
    return (r.nan_count, r.posinf_count, r.neginf_count, r.first_bad_index)


def check_scan(x, what):
    expect(scanned(x) == reference(x), f"scan {what} shape={list(x.shape)} strides={x.stride()}")


def plant(x):
    flat = x.view(-1) if x.is_contiguous() else None
    if flat is not None and flat.numel() > 2:
        flat[-1] = NAN
        flat[flat.numel() // 2] = -INF
        flat[1] = INF
    return x


# 1. the scan: contiguous, single-block (<= 32768) and multi-block sizes, clean and planted
for n in (0, 5, 32769) if SMALL else (0, 1, 3, 4, 5, 17, 1023, 32768, 32769, 100_003, (1 << 18) + 3):
    x = torch.randn(n, device=dev)
    check_scan(x, f"clean n={n}")
    check_scan(plant(x), f"planted n={n}")
# misaligned starts (the scalar head before 16-byte vector loads) and odd tails
base = torch.randn(40_000 + 8, device=dev)
for off in (1,) if SMALL else (1, 2, 3):
    for n in (7, 40_000) if SMALL else (1, 5, 7, 4099, 40_000):
        v = base[off:off + n]
        check_scan(v, f"offset {off} n={n}")
        w = v.clone()
        w[0], w[-1] = NAN, INF
        check_scan(base.new_empty(n + off + 1)[off:off + n].copy_(w), f"offset {off} planted n={n}")
# strided views: no copy, any strides
m = plant(torch.randn(300, 200, device=dev))
views = {
    "transposed": m.t(),
    "step": m[::3, ::2],
    "offset-strided": m.view(-1)[7:].as_strided((150, 90), (131, 2)),
    "expanded": plant(torch.randn(1, 5000, device=dev)).expand(64, 5000),
    "permuted-4d": plant(torch.randn(6, 7, 8, 9, device=dev)).permute(2, 0, 3, 1),
    "channels-last": plant(torch.randn(4, 16, 9, 9, device=dev)).contiguous(memory_format=torch.channels_last),
    "18-dims": plant(torch.randn([2] * 18, device=dev)).permute(*reversed(range(18))),
    "big-strided": plant(torch.randn(600, 1000, device=dev))[:, ::3],
}
for name, v in views.items():
    if not SMALL or name in ("transposed", "big-strided"):
        check_scan(v, name)

# 2. the guarded GEMM, forward + backward (+ double backward once), against F.linear
def check_linear(batch, fin, fout, bias=True, view=None, mode="sync"):
    layer = cg.SafeLinear(fin, fout, bias=bias, device=dev, name=f"w{fin}x{fout}", mode=mode)
    x = torch.randn(*batch, fin, device=dev) if view is None else view
    x = x.detach().requires_grad_(True)
    y = layer(x)
    ref = F.linear(x, layer.weight, layer.bias)
    expect(torch.allclose(y, ref, rtol=1e-4, atol=1e-5), f"forward {batch} {fin}->{fout}")
    if y.numel():
        g = torch.randn_like(y)
        params = [p for p in (layer.weight, layer.bias) if p is not None]
        got = torch.autograd.grad(y, [x, *params], g)
        want = torch.autograd.grad(ref, [x, *params], g)
        for a, b in zip(got, want):
            expect(torch.allclose(a, b, rtol=1e-4, atol=1e-4), f"backward {batch} {fin}->{fout}")


for batch, fin, fout in (((7,), 13, 5),) if SMALL else (((1,), 1, 1), ((7,), 13, 5), ((64,), 256, 128), ((3, 5), 33, 17), ((0,), 8, 4)):
    check_linear(batch, fin, fout)
    check_linear(batch, fin, fout, bias=False)
check_linear(None, 40, 24, view=torch.randn(40, 50, device=dev).t())              # transposed input
check_linear(None, 40, 24, view=torch.randn(50, 97, device=dev)[:, 3:43])         # lda != k, misaligned
check_linear(None, 40, 24, view=torch.randn(1, 40, device=dev).expand(30, 40))    # zero stride: a copy
check_linear(None, 40, 24, view=torch.randn(60, 120, device=dev)[::2, ::3])       # both dims strided
layer = cg.SafeLinear(16, 8, device=dev, name="double")
x = torch.randn(5, 16, device=dev, requires_grad=True)
(gx,) = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
gx.sum().backward()
expect(layer.weight.grad is not None and bool(torch.isfinite(layer.weight.grad).all()), "double backward")

# 3. sync-mode refusals and async-mode records (the record written from the device)
bad = torch.randn(70_000, 16, device=dev)
bad[69_999, 15] = NAN
bad[123, 4] = -INF
for mode in ("sync", "async"):
    layer = cg.SafeLinear(16, 8, device=dev, name=f"{mode}-layer", mode=mode)
    try:
        layer(bad)
        cg.check()
        expect(False, f"{mode}: no error for a NaN input")
    except cg.NonFiniteInputError as err:
        expect((err.nan_count, err.neginf_count, err.first_bad_index) == (1, 1, 123 * 16 + 4),
               f"{mode}: the error's findings")
    check_linear((9,), 16, 8, mode=mode)
    cg.check()
# async: several clean calls, one bad (multi-block), more clean calls; exactly one report
layer = cg.SafeLinear(16, 8, device=dev, name="async-many", mode="async")
for i in range(6):
    layer(bad if i == 2 else bad[:1000].nan_to_num())
    if i == 2:
        try:
            cg.check()
            expect(False, "async: nothing recorded")
        except cg.NonFiniteInputError as err:
            expect(err.deferred and err.call >= 3, "async: the recorded call")
cg.check()
try:
    cg.check_features(bad, 16, name="features")
    expect(False, "check_features passed a NaN")
except cg.NonFiniteInputError:
    pass
# Every mode and dtype on the run's GEMM path (CUBLAS_GUARD_GEMM_PATH: with lt, cuBLASLt's bias
# epilogue for bfloat16/float16 and the bias prefill fused into the input's scan, or alone in off
# mode, for float32/float64); outputs past one block's prefill (> 32768 elements). With the test
# hooks on (CUBLAS_GUARD_EXT_TESTING=1, as gpu_check.sh sets it) on both paths, one after the other.
testing = os.environ.get("CUBLAS_GUARD_EXT_TESTING") == "1"
paths = ("legacy", "lt") if testing else (os.environ.get("CUBLAS_GUARD_GEMM_PATH") or "legacy",)
for path in paths:
    if testing:
        torch.ops.cublas_guard_testing.set_gemm_path(path)
    for dtype, tol in ((torch.float32, 1e-4), (torch.float64, 1e-10), (torch.bfloat16, 3e-2), (torch.float16, 1e-2)):
        for mode in ("off", "async", "sync"):
            for rows, fin, fout in ((700, 48, 96),) if SMALL else ((7, 24, 40), (700, 48, 96)):
                layer = cg.SafeLinear(fin, fout, device=dev, dtype=dtype, name=f"path-{mode}", mode=mode)
                x = torch.randn(rows, fin, device=dev, dtype=dtype)
                with torch.no_grad():
                    y, ref = layer(x), F.linear(x, layer.weight, layer.bias)
                scale = float(ref.abs().max()) or 1.0
                expect(float((y.double() - ref.double()).abs().max()) <= tol * scale,
                       f"{dtype} {mode} {rows}x{fin}->{fout} on path {path}")
cg.check()
if dev == "cuda":
    torch.cuda.synchronize()
print(f"WORKLOAD OK: {checks} checks on {dev}", flush=True)
PYEOF

if [ "${1:-}" = "--workload-only" ]; then
  exec "$PY" "$WORKLOAD"
fi

SUMMARY=()
STATUS=0  # 0 clean, 1 found something, 2 incomplete
incomplete() { [ "$STATUS" -eq 0 ] && STATUS=2; }

find_sanitizer() {
  if [ -n "${SANITIZER:-}" ]; then [ -x "$SANITIZER" ] && echo "$SANITIZER"; return; fi
  command -v compute-sanitizer 2>/dev/null && return
  for d in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-*; do
    if [ -n "$d" ] && [ -x "$d/bin/compute-sanitizer" ]; then echo "$d/bin/compute-sanitizer"; return; fi
  done
}
CS="$(find_sanitizer)"
echo "gpu_extra_checks: budget ${BUDGET_S}s; python $PY; sanitizer ${CS:-not found}; logs in $LOG_DIR"

if [ -z "$CS" ]; then
  for tool in $TOOLS; do SUMMARY+=("gpu_extra_checks: $tool: SKIPPED (compute-sanitizer not found)"); done
  STATUS=2
else
  "$CS" --version 2>&1 | head -3
  # The probe: does this device let compute-sanitizer run a kernel at all?
  PROBE_DIR="$LOG_DIR/probe"
  mkdir -p "$PROBE_DIR"
  cat >"$PROBE_DIR/probe.cu" <<'CUEOF'
#include <cstdio>
__global__ void fill(int* p) { p[threadIdx.x] = static_cast<int>(threadIdx.x); }
int main() {
  int* p = nullptr;
  cudaError_t e = cudaMalloc(&p, 32 * sizeof(int));
  if (e == cudaSuccess) { fill<<<1, 32>>>(p); e = cudaDeviceSynchronize(); }
  std::printf("PROBE %s\n", e == cudaSuccess ? "OK" : cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
CUEOF
  NVCC="$(command -v nvcc || true)"
  [ -z "$NVCC" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] && NVCC="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
  PROBE=()
  if [ -n "$NVCC" ] && timeout 60 "$NVCC" -arch=native -o "$PROBE_DIR/probe" "$PROBE_DIR/probe.cu" >"$PROBE_DIR/nvcc.log" 2>&1; then
    PROBE=("$PROBE_DIR/probe")
  else
    PROBE=("$PY" -c "import torch; x = torch.ones(32, device='cuda'); torch.cuda.synchronize(); print('PROBE OK' if float(x.sum()) == 32 else 'PROBE WRONG')")
  fi
  timeout 60 "${PROBE[@]}" >"$PROBE_DIR/plain.log" 2>&1
  timeout 60 "$CS" --tool memcheck "${PROBE[@]}" >"$PROBE_DIR/sanitized.log" 2>&1
  PRC=$?
  if ! grep -q '^PROBE OK' "$PROBE_DIR/plain.log"; then
    echo "probe failed without the sanitizer too: $(tail -1 "$PROBE_DIR/plain.log")"
  elif ! grep -q '^PROBE OK' "$PROBE_DIR/sanitized.log"; then
    WHY=$(grep -m1 -iE 'not supported|error|fail' "$PROBE_DIR/sanitized.log" | tr -s ' ' | cut -c1-160)
    tail -5 "$PROBE_DIR/sanitized.log"
    for tool in $TOOLS; do
      SUMMARY+=("gpu_extra_checks: $tool: COULD NOT RUN HERE (a probe kernel runs, but not under compute-sanitizer: rc $PRC, ${WHY:-no output})")
    done
    TOOLS=""
    STATUS=3
  fi
  # Options this compute-sanitizer may not know are tried on /bin/true first and dropped if refused.
  accepts() { "$CS" "$@" /bin/true >/dev/null 2>&1; }
  n_tools=$(echo $TOOLS | wc -w)
  i=0
  for tool in $TOOLS; do
    i=$((i + 1))
    LEFT=$(left)
    # memcheck (first, the one that matters most) gets 60% of the budget when both run; each
    # later tool shares what is left; a 3 s margin for the summary.
    if [ "$i" -eq 1 ] && [ "$n_tools" -gt 1 ]; then T=$(( (LEFT - 3) * 6 / 10 ))
    else T=$(( (LEFT - 3) / (n_tools - i + 1) )); fi
    if [ "$T" -lt 10 ]; then
      SUMMARY+=("gpu_extra_checks: $tool: SKIPPED (budget spent: ${LEFT}s left)")
      incomplete
      continue
    fi
    ARGS=(--tool "$tool" --error-exitcode 99)
    accepts --tool "$tool" --report-api-errors no && ARGS+=(--report-api-errors no)
    ENVS=()
    case "$tool" in
      memcheck) ENVS+=(PYTORCH_NO_CUDA_MEMORY_CACHING=1) ;;
      racecheck)
        accepts --tool racecheck --racecheck-report all && ARGS+=(--racecheck-report all)
        accepts --tool racecheck --kernel-name kns=cublas_guard && ARGS+=(--kernel-name kns=cublas_guard) ;;
    esac
    LOG="$LOG_DIR/$tool.log"
    echo "== $tool (limit ${T}s): $CS ${ARGS[*]} $PY sanitizer_workload.py"
    S=$(date +%s)
    env "${ENVS[@]}" timeout -k 5 "$T" "$CS" "${ARGS[@]}" "$PY" "$WORKLOAD" >"$LOG" 2>&1
    RC=$?
    DT=$(( $(date +%s) - S ))
    tail -n 15 "$LOG"
    ERRS=$(grep -Eo 'ERROR SUMMARY: [0-9]+ error' "$LOG" | tail -1 | grep -Eo '[0-9]+')
    HAZ=$(grep -Eo 'RACECHECK SUMMARY: [0-9]+ hazard' "$LOG" | tail -1 | grep -Eo '[0-9]+')
    WL=$(grep -E '^WORKLOAD (OK|MISMATCH|SKIP)' "$LOG" | tail -1)
    if [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; then
      SUMMARY+=("gpu_extra_checks: $tool: INCOMPLETE (hit the ${T}s limit; ${ERRS:-no} errors so far) in ${DT} s")
      [ -n "$ERRS" ] && [ "$ERRS" -gt 0 ] && STATUS=1 || incomplete
    elif echo "$WL" | grep -q '^WORKLOAD SKIP'; then
      SUMMARY+=("gpu_extra_checks: $tool: SKIPPED ($WL)")
      incomplete
    elif [ "$RC" -eq 99 ] || { [ -n "$ERRS" ] && [ "$ERRS" -gt 0 ]; } || { [ -n "$HAZ" ] && [ "$HAZ" -gt 0 ]; }; then
      SUMMARY+=("gpu_extra_checks: $tool: FOUND ${ERRS:-?} errors${HAZ:+, $HAZ hazards} in ${DT} s (see $LOG)")
      STATUS=1
    elif [ "$RC" -ne 0 ] || ! echo "$WL" | grep -q '^WORKLOAD OK'; then
      SUMMARY+=("gpu_extra_checks: $tool: FAILED (exit $RC; ${WL:-the workload did not finish}) in ${DT} s (see $LOG)")
      STATUS=1
    else
      SUMMARY+=("gpu_extra_checks: $tool: CLEAN (${ERRS:-0} errors${HAZ:+, $HAZ hazards}) in ${DT} s, ${WL#WORKLOAD }")
    fi
  done
fi

echo
printf '%s\n' "${SUMMARY[@]}" | tee "$LOG_DIR/summary.txt"
exit "$STATUS"
