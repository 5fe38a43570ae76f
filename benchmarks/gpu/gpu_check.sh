#!/usr/bin/env bash
# One script for the lent GPU machine (an H200; Python 3.12, torch 2.11.0+cu130, nvcc 13.0, ninja,
# pytest, pytest-timeout, hypothesis, triton; no network; the repository arrives as a working tree;
# it starts bare every time). From the repository root:
#
#     bash benchmarks/gpu/gpu_check.sh            # the slots below, in order
#     bash benchmarks/gpu/gpu_check.sh --dry-run  # print the plan and the commands, run nothing (any machine)
#
# BUDGET PLAN. A task that is lent the machine gets 15 minutes of device time for all its calls
# together: the machine's start (a minute or more), every command, the idle waits. One run of this
# script must fit in 8 minutes so that a fix and a second run still fit: it stops itself after
# GPU_CHECK_TOTAL_S = 450 s (7.5 min); call it with the device tool's timeout_s = 480. The slots run
# in the order issue 19 asks for; each has its own limit, a slot never takes the time of a later
# one's reserve, and each writes its result (summary.txt, its junit xml) before the next starts, so
# a run cut short still says what it saw:
#
#   slot       limit   what
#   env          ~5 s  nvidia-smi, nvcc, torch, pytest-timeout, hypothesis, xdist
#   build       150 s  sm_90 only (TORCH_CUDA_ARCH_LIST=9.0), MAX_JOBS=nproc:
#                      pip install --no-build-isolation --no-deps -e . (fallback: setup.py build_ext)
#   smoke        30 s  about 20 s of tests, serial: the shared C++ runtime (tests/test_libstdcxx.py:
#                      NEEDED libstdc++.so.6, no std::locale/ios_base defined, an error formatting
#                      integers in a fresh process, on CUDA too); bfloat16/float16/float64 forward and
#                      backward against F.linear on both GEMM paths; every dtype's _64 routine through
#                      the lowered size limit; a scan of more than 2^31 elements, contiguous and
#                      strided; one watch producer test on CUDA
#   tests       110 s  every CUDA test of the suite in one pytest-xdist run (-m "not slow";
#                      benchmarks/gpu/select_cuda_tests.py keeps the tests that skip without a GPU
#                      or run on the cuda device)
#   bench        80 s  run.py --preset gpu twice, side by side: CUBLAS_GUARD_GEMM_PATH=legacy (the
#                      default) then =lt (cuBLASLt bias epilogue, fused prefill), 25 s of cases each,
#                      the target rows first; killed at 80 s
#   sanitizer    50 s  compute-sanitizer memcheck (benchmarks/gpu/gpu_extra_checks.sh) on its workload, a
#                      subset of the CUDA tests' paths, with CUBLAS_GUARD_GEMM_PATH=lt (the new
#                      kernels); a device that refuses the tool is reported as NORUN, not a finding
#   pack         ~5 s  the summary, and everything else packed into one archive
#
# Each pytest run is stopped with SIGINT at its slot's limit (pytest then still prints its
# summary, --durations and writes its junit xml; SIGKILL 30 s later only if it hangs), and
# each test with pytest-timeout (--timeout 120, when installed) so a single hang cannot eat a slot.
#
# OUTPUT. Everything goes under $OUT (the device tool copies $OUT back), else
# benchmarks/results/gpu-check/. While it runs, details go to $OUT/details/; at the end they are
# packed into $OUT/gpu_check_details.tar.gz and, when $OUT is set, removed, leaving:
#   summary.txt (rewritten after every slot, printed last too), gpu_check.log, junit-smoke.xml,
#   junit-tests.xml, targets-legacy.txt, targets-lt.txt, RESULTS.md, gpu_check_details.tar.gz
# Exit status: 0 if the build, the smoke step and the tests passed, else 1 (benchmark misses, a
# sanitizer finding or a sanitizer that could not run do not fail it; the summary says so).
#
# Budgets can be overridden by environment: GPU_CHECK_TOTAL_S, GPU_CHECK_BUILD_S, GPU_CHECK_SMOKE_S,
# GPU_CHECK_TESTS_S, GPU_CHECK_BENCH_S (new cases started per GEMM path; killed 30 s after both),
# GPU_CHECK_SANITIZER_S, GPU_CHECK_SANITIZER_TOOLS ("memcheck"), GPU_CHECK_TEST_TIMEOUT_S (per test).
set -u -o pipefail

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT_DIR="${OUT:-$ROOT/benchmarks/results/gpu-check}"
DETAILS="$OUT_DIR/details"
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
TOTAL_S="${GPU_CHECK_TOTAL_S:-450}"
BUILD_S="${GPU_CHECK_BUILD_S:-150}"
SMOKE_S="${GPU_CHECK_SMOKE_S:-30}"
TESTS_S="${GPU_CHECK_TESTS_S:-110}"
BENCH_S="${GPU_CHECK_BENCH_S:-25}"
SANITIZER_S="${GPU_CHECK_SANITIZER_S:-50}"
TEST_TIMEOUT_S="${GPU_CHECK_TEST_TIMEOUT_S:-120}"
WORKERS="${GPU_CHECK_WORKERS:-8}"  # pytest-xdist workers (one GPU, 16 cores); 1: serial
SANITIZER_TOOLS="${GPU_CHECK_SANITIZER_TOOLS:-memcheck}"  # racecheck too needs about 2 minutes more
BENCH_HARD_S=$(( 2 * BENCH_S + 30 ))
PACK_S=10  # kept free at the end for the summary and the archive
EXTRA_HOOK="$ROOT/benchmarks/gpu/gpu_extra_checks.sh"
GEMM_PATHS=(legacy lt)
SMOKE_TESTS=(tests/test_libstdcxx.py tests/test_gpu_smoke.py
             tests/test_dtypes.py::test_split_and_64bit_per_dtype
             tests/test_watch.py::test_per_device_forward_producer_named_by_module_and_op)
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( TOTAL_S - $(elapsed) )); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
# What a slot may use: its own limit, but never the reserves of the slots after it.
slot_limit() { min "$1" "$(( $(left) - $2 ))"; }

STEPS=()   # "name|status|seconds|note"
# Each slot's result is written at once (summary.txt), so a run cut short still says what it saw.
record() { STEPS+=("$1|$2|$3|$4"); write_summary >/dev/null; }
write_summary() {
  {
    echo
    echo "== gpu_check.sh summary ($(elapsed)s of ${TOTAL_S}s; $(date -u '+%Y-%m-%d %H:%M UTC'); outputs in $OUT_DIR)"
    printf '%-9s %-8s %6s  %s\n' slot status seconds note
    local s name status secs note
    for s in "${STEPS[@]}"; do
      IFS='|' read -r name status secs note <<<"$s"
      printf '%-9s %-8s %6s  %s\n' "$name" "$status" "$secs" "$note"
    done
    local gp
    for gp in "${GEMM_PATHS[@]}"; do
      if [ -f "$DETAILS/bench-$gp/targets.txt" ]; then
        echo "-- targets, CUBLAS_GUARD_GEMM_PATH=$gp (benchmarks/run.py --preset gpu):"
        cat "$DETAILS/bench-$gp/targets.txt"
      fi
    done
  } | tee "$OUT_DIR/summary.txt"
}

PYTEST_COMMON=(-q -p no:cacheprovider --durations=15 -o junit_logging=no)
# pytest with SIGINT restored: a shell that runs this script in the background starts it with
# SIGINT ignored, and Python then never raises KeyboardInterrupt. One interrupt is enough (timeout
# signals the child and its group).
PYTEST=("$PY" -c 'import signal, sys
def stop(signum, frame):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt
signal.signal(signal.SIGINT, stop)
import pytest
sys.exit(pytest.main(sys.argv[1:]))')
PYTEST_TIMEOUT=()
IGNORE=()
XDIST=()

if [ "$DRY_RUN" = 1 ]; then
  echo "gpu_check.sh --dry-run (nothing is built or run)"
  echo "  repository: $ROOT"
  echo "  outputs:    $OUT_DIR (details in $DETAILS, packed at the end)"
  echo "  python:     $(command -v "$PY") ($("$PY" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null))"
  echo "  plan:       total ${TOTAL_S}s (device timeout_s 480); build ${BUILD_S}s; smoke ${SMOKE_S}s; tests ${TESTS_S}s;" \
       "bench ${BENCH_S}s per GEMM path (killed at ${BENCH_HARD_S}s); sanitizer ${SANITIZER_S}s; ${PACK_S}s to pack"
  echo "  slot 1 build:     TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=\$(nproc) timeout -s INT ${BUILD_S} $PY -m pip install --no-build-isolation --no-deps -e ."
  echo "  slot 2 smoke:     timeout -s INT -k 30 ${SMOKE_S} $PY -m pytest ${SMOKE_TESTS[*]} -k 'not cpu' ${PYTEST_COMMON[*]} --timeout ${TEST_TIMEOUT_S} --junitxml=$OUT_DIR/junit-smoke.xml"
  echo "  slot 3 tests:     PYTHONPATH=benchmarks/gpu timeout -s INT -k 30 <min(${TESTS_S}, left - reserves)> $PY -m pytest tests -m 'not slow' -p select_cuda_tests -n $WORKERS ${PYTEST_COMMON[*]} --timeout ${TEST_TIMEOUT_S} --junitxml=$OUT_DIR/junit-tests.xml"
  for gp in "${GEMM_PATHS[@]}"; do
    echo "  slot 4 bench:     CUBLAS_GUARD_GEMM_PATH=$gp timeout -s INT <share of ${BENCH_HARD_S}> $PY benchmarks/run.py --preset gpu --budget-s ${BENCH_S} --out $DETAILS/bench-$gp --results-md $DETAILS/RESULTS-$gp.md"
  done
  if [ -f "$EXTRA_HOOK" ]; then
    echo "  slot 5 sanitizer: CUBLAS_GUARD_GEMM_PATH=lt GPU_EXTRA_BUDGET_S=$(( SANITIZER_S - 10 )) TOOLS=\"$SANITIZER_TOOLS\" OUT_EXTRA=$DETAILS/sanitizer timeout -k 5 ${SANITIZER_S} bash benchmarks/gpu/gpu_extra_checks.sh"
  else
    echo "  slot 5 sanitizer: (benchmarks/gpu/gpu_extra_checks.sh absent: skipped)"
  fi
  echo "  after each slot:  $OUT_DIR/summary.txt rewritten; at the end details packed into $OUT_DIR/gpu_check_details.tar.gz"
  echo "The benchmark plan (headline rows first):"
  timeout 120 "$PY" benchmarks/run.py --preset gpu --dry-run 2>&1 | sed -n '1,3p'
  exit 0
fi

mkdir -p "$OUT_DIR" "$DETAILS"
rm -f "$OUT_DIR"/summary.txt "$OUT_DIR"/junit-*.xml "$OUT_DIR"/gpu_check_details.tar.gz
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"

# pytest NAME LIMIT JUNIT ARGS...: one test slot, stopped with SIGINT at LIMIT seconds.
run_pytest() {
  local name=$1 limit=$2 junit=$3 rc t s summary
  shift 3
  if [ "$limit" -lt 15 ]; then record "$name" SKIP 0 "no time left"; return 1; fi
  echo "== $name: pytest $* (stopped with SIGINT after ${limit}s)"
  s=$(date +%s)
  timeout -s INT -k 30 "$limit" "${PYTEST[@]}" "$@" "${PYTEST_COMMON[@]}" "${PYTEST_TIMEOUT[@]}" "${IGNORE[@]}" \
      --junitxml="$junit" >"$DETAILS/pytest-$name.log" 2>&1
  rc=$?
  t=$(( $(date +%s) - s ))
  tail -40 "$DETAILS/pytest-$name.log"
  summary=$(grep -E '(passed|failed|error|skipped|no tests ran).* in [0-9.]+s' "$DETAILS/pytest-$name.log" | tail -1)
  case $rc in
    0) record "$name" PASS "$t" "$summary" ;;
    5) record "$name" PASS "$t" "no tests collected: $summary" ;;
    2|124|130) record "$name" STOPPED "$t" "stopped at ${limit}s (SIGINT); $summary" ;;
    137) record "$name" KILLED "$t" "hung past SIGINT, killed; see details/pytest-$name.log" ;;
    *) record "$name" FAIL "$t" "rc $rc; $summary" ;;
  esac
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ]
}

main() {
echo "== gpu_check.sh $(date -u '+%Y-%m-%d %H:%M:%S UTC') in $ROOT; outputs in $OUT_DIR; total ${TOTAL_S}s"

# ---- env --------------------------------------------------------------------------------------
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
  command -v nvcc >/dev/null && nvcc --version | tail -2
  "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| torch CUDA", torch.version.cuda,
      "| cuda available", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
for name in ("pytest_timeout", "hypothesis", "triton", "matplotlib"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "present"))
    except Exception as e:
        print(f"{name}: not importable ({type(e).__name__})")
EOF
} 2>&1 | tee "$DETAILS/environment.txt"
if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then
  PYTEST_TIMEOUT=(--timeout "$TEST_TIMEOUT_S" --timeout-method signal)
fi
# pytest-xdist: a test that crashes the interpreter (seen: a segfault in a CUDA error path,
# 2026-11-30) then costs one worker, not the rest of the slot, and every failure is listed.
if [ "$WORKERS" -gt 1 ] && "$PY" -c "import xdist" >/dev/null 2>&1; then
  XDIST=(-n "$WORKERS")
fi
if ! "$PY" -c "import hypothesis" >/dev/null 2>&1; then
  # Property tests need hypothesis; leave their files out rather than fail collection.
  for f in $(grep -l -E '^(import|from) hypothesis' tests/*.py 2>/dev/null); do IGNORE+=("--ignore=$f"); done
fi

# ---- slot 1: build (sm_90 only) ----------------------------------------------------------------
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
RESERVE_AFTER_BUILD=$(( SMOKE_S + TESTS_S + BENCH_HARD_S + SANITIZER_S + PACK_S ))
B=$(slot_limit "$BUILD_S" "$RESERVE_AFTER_BUILD")
echo "== build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS, CUDA_HOME=${CUDA_HOME:-unset}, limit ${B}s)"
S=$(date +%s)
timeout -k 5 "$B" "$PY" -m pip install --no-build-isolation --no-deps -e . >"$DETAILS/build.log" 2>&1
RC=$?
if [ $RC -ne 0 ]; then
  echo "pip install -e . failed (rc $RC; tail below); trying setup.py build_ext --inplace"
  tail -25 "$DETAILS/build.log"
  LEFT_BUILD=$(( B - ($(date +%s) - S) ))
  if [ "$LEFT_BUILD" -gt 30 ]; then
    timeout -k 5 "$LEFT_BUILD" "$PY" setup.py build_ext --inplace >>"$DETAILS/build.log" 2>&1
    RC=$?
  fi
fi
BUILD_T=$(( $(date +%s) - S ))
echo "build: rc $RC in ${BUILD_T}s (log: details/build.log)"
HAS_CUDA_OPS=0
if [ $RC -eq 0 ]; then
  if "$PY" - <<'EOF'
import sys, torch, cublas_guard_ext, cublas_guard_ext._native.loader as L
info = L.info()
print("extension:", info.kind, info.path, "| CUDA kernels:", info.has_cuda_kernels, "|", info.detail)
ok = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key("cublas_guard::linear", "CUDA")
print("CUDA kernels registered and a GPU visible:", ok)
sys.exit(0 if ok else 1)
EOF
  then HAS_CUDA_OPS=1; record build PASS "$BUILD_T" "sm_90 build, CUDA kernels registered"
  else record build FAIL "$BUILD_T" "built, but no CUDA kernels or no GPU"; fi
else
  tail -40 "$DETAILS/build.log"
  record build FAIL "$BUILD_T" "rc $RC (124: over ${B}s), see details/build.log"
fi

# ---- slot 2: smoke (serial: xdist's start would cost more than the tests) ----------------------
SMOKE_OK=0
if [ "$HAS_CUDA_OPS" = 1 ]; then
  T=$(slot_limit "$SMOKE_S" $(( TESTS_S + BENCH_HARD_S + SANITIZER_S + PACK_S )))
  run_pytest smoke "$T" "$OUT_DIR/junit-smoke.xml" "${SMOKE_TESTS[@]}" -k "not cpu" && SMOKE_OK=1
else
  record smoke SKIP 0 "no CUDA build"
fi

# ---- slot 3: every CUDA test, one xdist run -----------------------------------------------------
TESTS_OK=0
if [ "$HAS_CUDA_OPS" = 1 ]; then
  T=$(slot_limit "$TESTS_S" $(( BENCH_HARD_S + SANITIZER_S + PACK_S )))
  export PYTHONPATH="$ROOT/benchmarks/gpu${PYTHONPATH:+:$PYTHONPATH}"
  run_pytest tests "$T" "$OUT_DIR/junit-tests.xml" tests -m "not slow" -p select_cuda_tests "${XDIST[@]}" \
    && TESTS_OK=1
else
  record tests SKIP 0 "no CUDA build"
fi

# ---- slot 4: the benchmarks, both GEMM paths side by side ---------------------------------------
if [ "$HAS_CUDA_OPS" = 1 ]; then
  HARD=$(slot_limit "$BENCH_HARD_S" $(( SANITIZER_S + PACK_S )))
  PART=$(( HARD / 2 ))
  for gp in "${GEMM_PATHS[@]}"; do
    BS=$(( PART - 15 ))
    if [ "$BS" -lt 10 ]; then record "bench-$gp" SKIP 0 "no time left"; continue; fi
    echo "== bench-$gp: CUBLAS_GUARD_GEMM_PATH=$gp run.py --preset gpu (starts cases for ${BS}s, stopped at ${PART}s)"
    [ -f benchmarks/RESULTS.md ] && cp benchmarks/RESULTS.md "$DETAILS/RESULTS-$gp.md"
    S=$(date +%s)
    CUBLAS_GUARD_GEMM_PATH=$gp timeout -s INT -k 10 "$PART" "$PY" benchmarks/run.py --preset gpu \
        --out "$DETAILS/bench-$gp" --results-md "$DETAILS/RESULTS-$gp.md" --budget-s "$BS" \
        >"$DETAILS/bench-$gp.log" 2>&1
    BRC=$?
    BT=$(( $(date +%s) - S ))
    tail -20 "$DETAILS/bench-$gp.log"
    [ -f "$DETAILS/bench-$gp/targets.txt" ] && cp "$DETAILS/bench-$gp/targets.txt" "$OUT_DIR/targets-$gp.txt"
    if [ $BRC -eq 0 ]; then
      record "bench-$gp" DONE "$BT" "$(grep -c '^PASS' "$DETAILS/bench-$gp/targets.txt" 2>/dev/null) PASS, $(grep -c '^MISS' "$DETAILS/bench-$gp/targets.txt" 2>/dev/null) MISS; rows not started are listed as skipped"
    else
      record "bench-$gp" FAIL "$BT" "rc $BRC, see details/bench-$gp.log"
    fi
  done
else
  record bench SKIP 0 "no CUDA build"
fi

# ---- slot 5: compute-sanitizer, on the new GEMM path's kernels ---------------------------------
if [ ! -f "$EXTRA_HOOK" ]; then
  record sanitizer SKIP 0 "benchmarks/gpu/gpu_extra_checks.sh absent"
elif [ "$HAS_CUDA_OPS" != 1 ]; then
  record sanitizer SKIP 0 "no CUDA build"
else
  T=$(slot_limit "$SANITIZER_S" "$PACK_S")
  if [ "$T" -gt 15 ]; then
    echo "== sanitizer: benchmarks/gpu/gpu_extra_checks.sh, CUBLAS_GUARD_GEMM_PATH=lt (limit ${T}s)"
    mkdir -p "$DETAILS/sanitizer"
    S=$(date +%s)
    # The hook budgets itself with GPU_EXTRA_BUDGET_S; the outer limit leaves it 10 s to report.
    CUBLAS_GUARD_GEMM_PATH=lt GPU_EXTRA_BUDGET_S=$(( T - 10 )) OUT_EXTRA="$DETAILS/sanitizer" PYTHON="$PY" \
      TOOLS="$SANITIZER_TOOLS" timeout -k 5 "$T" bash "$EXTRA_HOOK" >"$DETAILS/sanitizer/extra_checks.log" 2>&1
    XRC=$?
    XT=$(( $(date +%s) - S ))
    tail -20 "$DETAILS/sanitizer/extra_checks.log"
    XNOTE=$(grep -h '^gpu_extra_checks: ' "$DETAILS/sanitizer/summary.txt" 2>/dev/null | sed 's/^gpu_extra_checks: //' | paste -sd ';' -)
    case $XRC in
      0) record sanitizer PASS "$XT" "${XNOTE:-clean}" ;;
      1) record sanitizer FOUND "$XT" "${XNOTE:-see details/sanitizer/extra_checks.log}" ;;
      2) record sanitizer INCOMPL "$XT" "${XNOTE:-incomplete, see details/sanitizer/extra_checks.log}" ;;
      3) record sanitizer NORUN "$XT" "could not run here: ${XNOTE:-the device refused compute-sanitizer}" ;;
      124|137) record sanitizer TIMEOUT "$XT" "limit ${T}s; ${XNOTE}" ;;
      *) record sanitizer FAIL "$XT" "rc $XRC, see details/sanitizer/extra_checks.log" ;;
    esac
  else
    record sanitizer SKIP 0 "no time left"
  fi
fi

# ---- summary (last) ---------------------------------------------------------------------------
write_summary
[ "$HAS_CUDA_OPS" = 1 ] && [ "$SMOKE_OK" = 1 ] && [ "$TESTS_OK" = 1 ]
}

main 2>&1 | tee -a "$LOG"
STATUS=${PIPESTATUS[0]}
# Pack: everything else in one archive.
[ -f "$DETAILS/RESULTS-lt.md" ] && cp "$DETAILS/RESULTS-lt.md" "$OUT_DIR/RESULTS.md"
[ -f "$DETAILS/RESULTS-legacy.md" ] && cp "$DETAILS/RESULTS-legacy.md" "$OUT_DIR/RESULTS-legacy.md"
tar -czf "$OUT_DIR/gpu_check_details.tar.gz" -C "$OUT_DIR" details 2>/dev/null \
  && [ -n "${OUT:-}" ] && rm -rf "$DETAILS"
exit "$STATUS"
