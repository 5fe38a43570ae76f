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
# in order of value; each has its own limit, a slot never takes the time of a later one's reserve,
# and time an earlier slot leaves unused goes to the "rest" slots at the end:
#
#   slot       limit   what
#   env          ~5 s  nvidia-smi, nvcc, torch, pytest-timeout, hypothesis
#   build       150 s  sm_90 only (TORCH_CUDA_ARCH_LIST=9.0), MAX_JOBS=nproc:
#                      pip install --no-build-isolation --no-deps -e . (fallback: setup.py build_ext)
#   core        100 s  the core path's CUDA tests: tests/test_cuda.py, test_async_record.py,
#                      test_cuda_errors.py (scan, GEMM, errors, async record, graphs, >2^31 batch)
#   bench        75 s  the benchmarks' headline rows: run.py --preset gpu starts cases for 45 s; its
#                      target shapes run first, then the scan rows; killed at 75 s
#   sanitizer    60 s  compute-sanitizer memcheck (benchmarks/gpu/gpu_extra_checks.sh) in its own slot: a
#                      few-second probe first; a device that refuses the tool is reported as
#                      "could not run here" (NORUN), not as a finding
#   rest    the rest   every other CUDA-parametrized test (-m "not slow" -k cuda), until 10 s before
#                      the total
#   pack         ~5 s  the summary, and everything else packed into one archive
#
# Tests run in 8 pytest-xdist workers when xdist is there (a crash costs one worker, not the slot).
# Each pytest run is stopped with SIGINT at its slot's limit (pytest then still prints its
# summary, --durations and writes its junit xml; SIGKILL 30 s later only if it hangs), and
# each test with pytest-timeout (--timeout 120, when installed) so a single hang cannot eat a slot.
#
# OUTPUT. Everything goes under $OUT (the device tool copies $OUT back: at most 8 files, 2 folders
# deep), else benchmarks/results/gpu-check/. While it runs, details go to $OUT/details/; at the end
# they are packed into $OUT/gpu_check_details.tar.gz and, when $OUT is set, removed, leaving:
#   summary.txt (the table, printed last too), gpu_check.log, junit-core.xml, junit-rest.xml,
#   RESULTS.md, results.json (the benchmark run), gpu_check_details.tar.gz
# Exit status: 0 if the build and both test slots passed, else 1 (benchmark misses, a sanitizer
# finding or a sanitizer that could not run do not fail it; the summary says so).
#
# Budgets can be overridden by environment: GPU_CHECK_TOTAL_S, GPU_CHECK_BUILD_S, GPU_CHECK_CORE_S,
# GPU_CHECK_BENCH_S (new cases started; killed 30 s later), GPU_CHECK_SANITIZER_S,
# GPU_CHECK_SANITIZER_TOOLS ("memcheck"), GPU_CHECK_TEST_TIMEOUT_S (per test).
set -u -o pipefail

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,45p' "$0"; exit 0 ;;
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
CORE_S="${GPU_CHECK_CORE_S:-100}"
BENCH_S="${GPU_CHECK_BENCH_S:-45}"
SANITIZER_S="${GPU_CHECK_SANITIZER_S:-60}"
TEST_TIMEOUT_S="${GPU_CHECK_TEST_TIMEOUT_S:-120}"
WORKERS="${GPU_CHECK_WORKERS:-8}"  # pytest-xdist workers (one GPU, 16 cores); 1: serial
SANITIZER_TOOLS="${GPU_CHECK_SANITIZER_TOOLS:-memcheck}"  # racecheck too needs about 2 minutes more
BENCH_HARD_S=$(( BENCH_S + 30 ))
PACK_S=10  # kept free at the end for the summary and the archive
EXTRA_HOOK="$ROOT/benchmarks/gpu/gpu_extra_checks.sh"
CORE_TESTS=(tests/test_cuda.py tests/test_async_record.py tests/test_cuda_errors.py)

T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( TOTAL_S - $(elapsed) )); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
# What a slot may use: its own limit, but never the reserves of the slots after it.
slot_limit() { min "$1" "$(( $(left) - $2 ))"; }

STEPS=()   # "name|status|seconds|note"
record() { STEPS+=("$1|$2|$3|$4"); }

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

if [ "$DRY_RUN" = 1 ]; then
  R_CORE=$(( BENCH_HARD_S + SANITIZER_S + PACK_S ))
  echo "gpu_check.sh --dry-run (nothing is built or run)"
  echo "  repository: $ROOT"
  echo "  outputs:    $OUT_DIR (details in $DETAILS, packed at the end)"
  echo "  python:     $(command -v "$PY") ($("$PY" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null))"
  echo "  plan:       total ${TOTAL_S}s (device timeout_s 480); build ${BUILD_S}s; core tests ${CORE_S}s;" \
       "bench ${BENCH_S}s (+30 s to finish); sanitizer ${SANITIZER_S}s; rest of the tests until ${PACK_S}s before the end"
  echo "  slot 1 build:     TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=\$(nproc) timeout -s INT ${BUILD_S} $PY -m pip install --no-build-isolation --no-deps -e ."
  echo "  slot 2 core:      timeout -s INT -k 30 <min(${CORE_S}, left - ${R_CORE})> $PY -m pytest ${CORE_TESTS[*]} ${PYTEST_COMMON[*]} --timeout ${TEST_TIMEOUT_S} --junitxml=$OUT_DIR/junit-core.xml"
  echo "  slot 3 bench:     timeout -s INT ${BENCH_HARD_S} $PY benchmarks/run.py --preset gpu --budget-s ${BENCH_S} --out $DETAILS/bench --results-md $DETAILS/RESULTS.md"
  if [ -f "$EXTRA_HOOK" ]; then
    echo "  slot 4 sanitizer: GPU_EXTRA_BUDGET_S=$(( SANITIZER_S - 10 )) TOOLS=\"$SANITIZER_TOOLS\" OUT_EXTRA=$DETAILS/sanitizer timeout -k 5 ${SANITIZER_S} bash benchmarks/gpu/gpu_extra_checks.sh"
  else
    echo "  slot 4 sanitizer: (benchmarks/gpu/gpu_extra_checks.sh absent: skipped)"
  fi
  echo "  slot 5 rest:      timeout -s INT -k 30 <left - ${PACK_S}> $PY -m pytest tests -m 'not slow' -k cuda $(printf -- '--ignore=%s ' "${CORE_TESTS[@]}")${PYTEST_COMMON[*]} --timeout ${TEST_TIMEOUT_S} --junitxml=$OUT_DIR/junit-rest.xml"
  echo "  both test slots:  + -n $WORKERS (pytest-xdist workers) when xdist is installed"
  echo "  then:             summary.txt; details packed into $OUT_DIR/gpu_check_details.tar.gz"
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
  PYTEST_COMMON+=(-n "$WORKERS")
fi
if ! "$PY" -c "import hypothesis" >/dev/null 2>&1; then
  # Property tests need hypothesis; leave their files out rather than fail collection.
  for f in $(grep -l -E '^(import|from) hypothesis' tests/*.py 2>/dev/null); do IGNORE+=("--ignore=$f"); done
fi

# ---- slot 1: build (sm_90 only) ----------------------------------------------------------------
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
RESERVE_AFTER_BUILD=$(( CORE_S + BENCH_HARD_S + SANITIZER_S + PACK_S ))
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

# ---- slot 2: the core path's CUDA tests ---------------------------------------------------------
CORE_OK=0
if [ "$HAS_CUDA_OPS" = 1 ]; then
  T=$(slot_limit "$CORE_S" $(( BENCH_HARD_S + SANITIZER_S + PACK_S )))
  run_pytest core "$T" "$OUT_DIR/junit-core.xml" "${CORE_TESTS[@]}" && CORE_OK=1
else
  record core SKIP 0 "no CUDA build"
fi

# ---- slot 3: the benchmarks' headline rows ------------------------------------------------------
if [ "$HAS_CUDA_OPS" = 1 ]; then
  HARD=$(slot_limit "$BENCH_HARD_S" $(( SANITIZER_S + PACK_S )))
  BS=$(( HARD - 30 ))
  if [ "$BS" -gt 10 ]; then
    echo "== bench: run.py --preset gpu (starts cases for ${BS}s, stopped at ${HARD}s)"
    [ -f benchmarks/RESULTS.md ] && cp benchmarks/RESULTS.md "$DETAILS/RESULTS.md"
    S=$(date +%s)
    timeout -s INT -k 10 "$HARD" "$PY" benchmarks/run.py --preset gpu --out "$DETAILS/bench" \
        --results-md "$DETAILS/RESULTS.md" --budget-s "$BS" >"$DETAILS/bench.log" 2>&1
    BRC=$?
    BT=$(( $(date +%s) - S ))
    tail -30 "$DETAILS/bench.log"
    if [ $BRC -eq 0 ]; then
      record bench DONE "$BT" "$(grep -c '^PASS' "$DETAILS/bench/targets.txt" 2>/dev/null) PASS, $(grep -c '^MISS' "$DETAILS/bench/targets.txt" 2>/dev/null) MISS; rows not started are listed as skipped"
    else
      record bench FAIL "$BT" "rc $BRC, see details/bench.log"
    fi
  else
    record bench SKIP 0 "no time left"
  fi
else
  record bench SKIP 0 "no CUDA build"
fi

# ---- slot 4: compute-sanitizer ----------------------------------------------------------------
if [ ! -f "$EXTRA_HOOK" ]; then
  record sanitizer SKIP 0 "benchmarks/gpu/gpu_extra_checks.sh absent"
elif [ "$HAS_CUDA_OPS" != 1 ]; then
  record sanitizer SKIP 0 "no CUDA build"
else
  T=$(slot_limit "$SANITIZER_S" "$PACK_S")
  if [ "$T" -gt 15 ]; then
    echo "== sanitizer: benchmarks/gpu/gpu_extra_checks.sh (limit ${T}s)"
    mkdir -p "$DETAILS/sanitizer"
    S=$(date +%s)
    # The hook budgets itself with GPU_EXTRA_BUDGET_S; the outer limit leaves it 10 s to report.
    GPU_EXTRA_BUDGET_S=$(( T - 10 )) OUT_EXTRA="$DETAILS/sanitizer" PYTHON="$PY" TOOLS="$SANITIZER_TOOLS" \
      timeout -k 5 "$T" bash "$EXTRA_HOOK" >"$DETAILS/sanitizer/extra_checks.log" 2>&1
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

# ---- slot 5: the rest of the CUDA tests ---------------------------------------------------------
REST_OK=0
if [ "$HAS_CUDA_OPS" = 1 ]; then
  T=$(slot_limit 100000 "$PACK_S")
  REST_IGNORE=()
  for f in "${CORE_TESTS[@]}"; do REST_IGNORE+=("--ignore=$f"); done
  run_pytest rest "$T" "$OUT_DIR/junit-rest.xml" tests -m "not slow" -k cuda "${REST_IGNORE[@]}" && REST_OK=1
else
  record rest SKIP 0 "no CUDA build"
fi

# ---- summary (last) ---------------------------------------------------------------------------
{
  echo
  echo "== gpu_check.sh summary ($(elapsed)s of ${TOTAL_S}s; $(date -u '+%Y-%m-%d %H:%M UTC'); outputs in $OUT_DIR)"
  printf '%-9s %-8s %6s  %s\n' slot status seconds note
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name status secs note <<<"$s"
    printf '%-9s %-8s %6s  %s\n' "$name" "$status" "$secs" "$note"
  done
  if [ -f "$DETAILS/bench/targets.txt" ]; then
    echo "-- targets (benchmarks/run.py --preset gpu):"
    cat "$DETAILS/bench/targets.txt"
  fi
} | tee "$OUT_DIR/summary.txt"
[ "$HAS_CUDA_OPS" = 1 ] && [ "$CORE_OK" = 1 ] && [ "$REST_OK" = 1 ]
}

main 2>&1 | tee -a "$LOG"
STATUS=${PIPESTATUS[0]}
# Pack: the device tool brings back at most 8 files, 2 folders deep.
[ -f "$DETAILS/RESULTS.md" ] && cp "$DETAILS/RESULTS.md" "$OUT_DIR/RESULTS.md"
[ -f "$DETAILS/bench/results.json" ] && cp "$DETAILS/bench/results.json" "$OUT_DIR/results.json"
tar -czf "$OUT_DIR/gpu_check_details.tar.gz" -C "$OUT_DIR" details 2>/dev/null \
  && [ -n "${OUT:-}" ] && rm -rf "$DETAILS"
exit "$STATUS"
