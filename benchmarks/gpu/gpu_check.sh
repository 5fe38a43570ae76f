#!/usr/bin/env bash
# The GPU check: two runs on the lent GPU machine (an H200; torch with CUDA, nvcc, ninja, pytest,
# pytest-xdist, pytest-timeout, hypothesis, transformers; no network; the repository arrives as a
# working tree; a fresh machine is bare, a warm one keeps the ignored build outputs). From the
# repository root:
#
#     bash benchmarks/gpu/gpu_check.sh --run 1        # device tool timeout_s 420
#     bash benchmarks/gpu/gpu_check.sh --run 2        # right after, while warm: timeout_s 240
#     bash benchmarks/gpu/gpu_check.sh --run 1 --dry-run   # every shell path here, GPU steps stubbed
#
# BUDGET PLAN. A task lent the machine gets 15 minutes of device time for everything: the cold
# start (1-3 minutes), both runs (420 + 240 s at most), the idle wait between them. Each run stops
# itself 30 s or more before its limit (run 1 at 380 s, run 2 at 210 s) so that its summary and archive still
# come back. A step never takes the time the steps after it reserve; each writes its result
# (summary.txt, steps.txt) before the next starts, so a run cut short still says what it saw.
#
#   run 1    limit  what
#   env       10 s  versions: GPU, driver, nvcc, torch, CUDA, cuBLAS, setuptools, pip, pytest,
#                   xdist, timeout, hypothesis, ninja, the C++ compiler
#   build    150 s  sm_90 only (TORCH_CUDA_ARCH_LIST=9.0), MAX_JOBS=nproc: pip install -e . with
#                   setuptools >= 77 (pyproject.toml's SPDX license needs it), else -- or when
#                   pip fails -- the package's JIT build (torch.utils.cpp_extension.load, the same
#                   sources and flags; it reads no pyproject.toml)
#   smoke     60 s  pytest --gpu-step smoke, serial: the C++ runtime in a fresh process, half and
#                   double precision on both GEMM paths, the _64 routines, one watch producer
#   tests    100 s  pytest --gpu-step tests -n 8: every other CUDA test but watch's, one xdist run
#                   (selected by what skips without a GPU or is parametrized on it:
#                   select_cuda_tests.py; -m "not slow")
#   bench     50 s  run.py --preset gpu-check on each GEMM path (CUBLAS_GUARD_GEMM_PATH=legacy,
#                   the default, then lt): the target rows (forward at M=8192, K=N=4096 in every
#                   dtype, the fixed cost per forward at M=32, K=N=1024), side by side in RESULTS.md
#   pack      10 s  RESULTS.md section, summary, the archive
#
#   run 2    limit  what
#   env        5 s  as run 1 (and a build, within the run's total, if the machine is bare)
#   watch-tests 40 s pytest --gpu-step watch: watch's CUDA tests (every tests/watch/test_*.py)
#   watch-bench 40 s benchmarks/watch_bench.py --device cuda --model gpt2 --bf16 (<= 1.10x)
#   guard-bench 35 s benchmarks/training_guard_bench.py --device cuda --model gpt2 --bf16 --fused
#                   (<= 1.02x)
#   sanitizer 80 s  compute-sanitizer memcheck (gpu_extra_checks.sh, WORKLOAD_SIZE=small: the
#                   guard's CUDA paths once each, the GEMMs on both paths) with
#                   PYTORCH_NO_CUDA_MEMORY_CACHING=1; memcheck
#                   over torch's start alone takes tens of seconds, so it runs last with the most
#   pack      10 s  as run 1
#
# OUTPUT. Under $OUT (the device tool brings back at most 8 files), else
# benchmarks/results/gpu-check-run<N>/: summary.txt, gpu_check.log, RESULTS.md (a copy of
# benchmarks/RESULTS.md with this run's section: date, card, driver, torch, CUDA, cuBLAS, the
# command, every target PASS/MISS), details.tar.gz (every log, junit file and benchmark result).
# Exit status: 0 when every test step passed (benchmark misses do not fail it), else 1.
#
# Overrides: GPU_CHECK_WORKERS (xdist workers, 8), GPU_CHECK_TEST_TIMEOUT_S (per test, 90),
# GPU_CHECK_SCALE (multiplies every budget and total: a shortened rehearsal), PYTHON.
set -u -o pipefail

RUN1_LIMIT_S=420
RUN1_TOTAL_S=380
RUN1_SLOTS="env:10 build:150 smoke:60 tests:100 bench:50 pack:10"
RUN2_LIMIT_S=240
RUN2_TOTAL_S=210
RUN2_SLOTS="env:5 watch-tests:40 watch-bench:40 guard-bench:35 sanitizer:80 pack:10"
MAX_FILES=8

RUN=1
DRY_RUN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --run) RUN="${2:-}"; shift ;;
    --run=*) RUN="${1#--run=}" ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$RUN" in 1|2) ;; *) echo "gpu_check.sh: --run takes 1 or 2, not '$RUN'" >&2; exit 2 ;; esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
# The checkout's package for every step, installed (pip install -e .) or JIT-built (no install).
# Not in a dry run, which runs no GPU step: there Python's own package serves (CI's installed-wheel
# suite runs this from a source copy with no library, which the first import would JIT-build with
# CUDA: minutes); run.py and gpu_results.py add the checkout themselves when nothing is installed.
if [ "$DRY_RUN" != 1 ]; then export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"; fi
OUT_DIR="${OUT:-$ROOT/benchmarks/results/gpu-check-run$RUN}"
DETAILS="$OUT_DIR/details"
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
WORKERS="${GPU_CHECK_WORKERS:-8}"
TEST_TIMEOUT_S="${GPU_CHECK_TEST_TIMEOUT_S:-90}"
SCALE="${GPU_CHECK_SCALE:-1}"
if [ "$RUN" = 1 ]; then TOTAL_S=$RUN1_TOTAL_S; SLOTS=$RUN1_SLOTS; else TOTAL_S=$RUN2_TOTAL_S; SLOTS=$RUN2_SLOTS; fi
scaled() { "$PY" -c "import sys; print(max(1, round(float(sys.argv[1]) * float(sys.argv[2]))))" "$1" "$SCALE"; }
TOTAL_S=$(scaled "$TOTAL_S")
declare -A BUDGET
ORDER=()
for slot in $SLOTS; do BUDGET[${slot%%:*}]=$(scaled "${slot#*:}"); ORDER+=("${slot%%:*}"); done
COMMAND="bash benchmarks/gpu/gpu_check.sh --run $RUN$([ "$DRY_RUN" = 1 ] && echo ' --dry-run')"

T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
# What a step may use: its own budget, but never what the steps after it reserve.
reserve_after() {
  local name=$1 seen=0 sum=0 s
  for s in "${ORDER[@]}"; do
    if [ "$seen" = 1 ]; then sum=$(( sum + BUDGET[$s] )); fi
    [ "$s" = "$name" ] && seen=1
  done
  echo "$sum"
}
step_limit() {
  local own=${BUDGET[$1]} room
  room=$(( TOTAL_S - $(elapsed) - $(reserve_after "$1") ))
  if [ "$room" -lt "$own" ]; then echo "$room"; else echo "$own"; fi
}

mkdir -p "$OUT_DIR"
rm -rf "$DETAILS" "$OUT_DIR"/summary.txt "$OUT_DIR"/gpu_check.log "$OUT_DIR"/RESULTS.md "$OUT_DIR"/details.tar.gz
mkdir -p "$DETAILS"
STEPS_FILE="$DETAILS/steps.txt"
: >"$STEPS_FILE"
LOG="$OUT_DIR/gpu_check.log"

# Each step's result is written at once, so a run cut short still says what it saw.
record() {
  echo "$1|$2|$3|$4" >>"$STEPS_FILE"
  write_summary >/dev/null
}
write_summary() {
  {
    echo "== gpu_check.sh --run $RUN$([ "$DRY_RUN" = 1 ] && echo ' (dry run: GPU steps stubbed)'):" \
         "$(elapsed)s of ${TOTAL_S}s; $(date -u '+%Y-%m-%d %H:%M UTC')"
    printf '%-12s %-8s %6s  %s\n' step status seconds note
    local name status secs note
    while IFS='|' read -r name status secs note; do
      printf '%-12s %-8s %6s  %s\n' "$name" "$status" "$secs" "$note"
    done <"$STEPS_FILE"
    if [ -f "$DETAILS/targets.txt" ]; then echo "-- targets:"; cat "$DETAILS/targets.txt"; fi
  } | tee "$OUT_DIR/summary.txt"
}

# gpu NAME LIMIT CMD...: one GPU step's command, stopped with SIGINT at LIMIT seconds (SIGKILL 15 s
# later); its output goes to details/NAME.log. A dry run prints the command and runs stub_NAME.
gpu() {
  local name=$1 limit=$2
  shift 2
  if [ "$DRY_RUN" = 1 ]; then
    echo "[dry-run] $name (limit ${limit}s): $*" | tee "$DETAILS/$name.log"
    "stub_$name" >>"$DETAILS/$name.log" 2>&1
    return $?
  fi
  timeout -s INT -k 15 "$limit" "$@" >"$DETAILS/$name.log" 2>&1
}

# The stubs of a dry run: what each step leaves behind, without a GPU.
stub_build() { echo "extension: stub (CUDA kernels registered)"; }
stub_pytest() { echo "1 passed in 0.01s"; printf '<testsuites/>\n' >"$DETAILS/junit-$1.xml"; }
stub_smoke() { stub_pytest smoke; }
stub_tests() { stub_pytest tests; }
stub_watch-tests() { stub_pytest watch-tests; }
stub_bench() { :; }
stub_bench-legacy() { "$PY" benchmarks/run.py --preset gpu-check --dry-run >"$DETAILS/bench-plan.txt" && head -3 "$DETAILS/bench-plan.txt"; }
stub_bench-lt() { echo "the same plan as bench-legacy's"; }
stub_watch-bench() { echo "watch(async) vs plain: 1.000x wall, 1.000x CPU time (goal: within 1.10x) [stub]"; }
stub_guard-bench() { echo "ratio TrainingGuard / plain: wall 1.000x, CPU 1.000x [stub]"; }
stub_sanitizer() { mkdir -p "$DETAILS/sanitizer"; echo "gpu_extra_checks: memcheck: CLEAN (0 errors) [stub]" | tee "$DETAILS/sanitizer/summary.txt"; }

PYTEST_COMMON=(-q -p no:cacheprovider --durations=10 -o junit_logging=no)
PYTEST_PLUGINS=()

# pytest_step NAME GPU_STEP PATHS ARGS...: one test step over the tests under PATHS (a
# space-separated list; select_cuda_tests.py keeps the step's own); PASS only when pytest says so.
pytest_step() {
  local name=$1 gpu_step=$2 limit rc t s summary
  local -a paths
  read -r -a paths <<<"$3"
  shift 3
  limit=$(step_limit "$name")
  if [ "$limit" -lt 15 ]; then record "$name" SKIP 0 "no time left"; return 1; fi
  echo "== $name: pytest --gpu-step $gpu_step (limit ${limit}s)"
  s=$(date +%s)
  # SIGINT restored: a shell that runs this script in the background starts it with SIGINT
  # ignored, and pytest would then never stop at the limit with its summary and junit file.
  PYTHONPATH="$ROOT/benchmarks/gpu${PYTHONPATH:+:$PYTHONPATH}" gpu "$name" "$limit" "$PY" -c 'import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
import pytest
sys.exit(pytest.main(sys.argv[1:]))' "${paths[@]}" -p select_cuda_tests --gpu-step "$gpu_step" -m "not slow" \
    "${PYTEST_COMMON[@]}" "${PYTEST_PLUGINS[@]}" "$@" --junitxml="$DETAILS/junit-$name.xml"
  rc=$?
  t=$(( $(date +%s) - s ))
  tail -15 "$DETAILS/$name.log"
  summary=$(grep -E '(passed|failed|error|skipped|no tests ran).* in [0-9.]+s' "$DETAILS/$name.log" | tail -1)
  case $rc in
    0) record "$name" PASS "$t" "$summary" ;;
    2|124|130) record "$name" STOPPED "$t" "stopped at ${limit}s; $summary" ;;
    137) record "$name" KILLED "$t" "hung past SIGINT; see details/$name.log" ;;
    *) record "$name" FAIL "$t" "rc $rc; $summary" ;;
  esac
  [ "$rc" -eq 0 ]
}

step_env() {
  local limit
  limit=$(step_limit env)
  {
    echo "== versions"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2 || true
    command -v nvcc >/dev/null && nvcc --version | tail -1
    echo "C++ compiler: $(${CXX:-c++} --version 2>&1 | head -1)"
    timeout "$limit" "$PY" - <<'EOF'
import importlib.metadata as md, platform
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| torch CUDA", torch.version.cuda,
      "| GPU", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
for dist in ("setuptools", "pip", "wheel", "ninja", "pytest", "pytest-xdist", "pytest-timeout", "hypothesis",
             "transformers", "nvidia-cublas-cu13", "nvidia-cublas-cu12", "nvidia-cublas"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist}: not installed")
EOF
  } 2>&1 | tee "$DETAILS/versions.txt"
  if "$PY" -c "import xdist" >/dev/null 2>&1 && [ "$WORKERS" -gt 1 ]; then XDIST=(-n "$WORKERS"); else XDIST=(); fi
  if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then
    PYTEST_PLUGINS=(--timeout "$TEST_TIMEOUT_S" --timeout-method signal)
  fi
  record env DONE "$(elapsed)" "$(grep -E '^(setuptools|pytest-xdist) ' "$DETAILS/versions.txt" | paste -sd ',' -)"
}

# Whether the checkout's extension, with its CUDA kernels, loads on a visible GPU. Bounded: with no
# build at all the import would start a JIT build (the build step's business, with its own limit).
has_cuda_build() {
  [ "$DRY_RUN" = 1 ] && return 0
  timeout -k 5 90 "$PY" - <<'EOF' >>"$DETAILS/build.log" 2>&1
import sys, torch, cublas_guard_ext._native.loading.loader as L
info = L.info()
print("extension:", info.kind, info.path, "| CUDA kernels:", info.has_cuda_kernels)
sys.exit(0 if info.has_cuda_kernels and torch.cuda.is_available() else 1)
EOF
}

# setuptools >= 77 reads pyproject.toml's SPDX license; an older one fails on it, in pip install
# and in setup.py alike, so the fallback is the package's JIT build, which reads no pyproject.toml.
setuptools_ok() {
  "$PY" - <<'EOF'
import sys, setuptools
major = int(setuptools.__version__.split(".")[0])
print(f"setuptools {setuptools.__version__}: {'pip install -e .' if major >= 77 else 'too old for the SPDX license: JIT build'}")
sys.exit(0 if major >= 77 else 1)
EOF
}

step_build() {
  local limit s rc how
  if [ "$RUN" = 1 ]; then
    limit=$(step_limit build)
  elif has_cuda_build; then
    record build PASS 0 "already built (warm machine)"
    return 0
  else
    limit=$(( TOTAL_S - $(elapsed) - 60 ))  # a bare machine: build first, keep a minute
  fi
  if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  echo "== build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS, limit ${limit}s)"
  s=$(date +%s)
  if [ "$DRY_RUN" = 1 ] || setuptools_ok | tee -a "$DETAILS/versions.txt"; then
    how="pip install -e ."
    gpu build "$limit" "$PY" -m pip install --no-build-isolation --no-deps -e .
    rc=$?
  else
    rc=1
    how="JIT build"
  fi
  if [ "$rc" -ne 0 ]; then
    [ "$how" = "pip install -e ." ] && { echo "pip install failed (rc $rc): the JIT build"; tail -15 "$DETAILS/build.log"; }
    how="JIT build"
    local left=$(( limit - ($(date +%s) - s) ))
    if [ "$left" -gt 20 ]; then
      gpu build-jit "$left" "$PY" -c 'import cublas_guard_ext._native.loading.loader as L; i = L.info(); print(i.kind, i.path, i.has_cuda_kernels, i.detail)'
      rc=$?
    fi
  fi
  if [ "$rc" -eq 0 ] && has_cuda_build; then
    record build PASS "$(( $(date +%s) - s ))" "$how for sm_90, CUDA kernels registered"
  else
    tail -30 "$DETAILS"/build*.log
    record build FAIL "$(( $(date +%s) - s ))" "$how: rc $rc, or no CUDA kernels; see details/build.log"
    return 1
  fi
}
stub_build-jit() { echo "jit stub True"; }

step_bench() {
  local limit gp part s rc
  limit=$(step_limit bench)
  part=$(( limit / 2 ))
  for gp in legacy lt; do
    if [ "$part" -lt 10 ]; then record "bench-$gp" SKIP 0 "no time left"; continue; fi
    echo "== bench-$gp: CUBLAS_GUARD_GEMM_PATH=$gp run.py --preset gpu-check (stopped at ${part}s)"
    s=$(date +%s)
    CUBLAS_GUARD_GEMM_PATH=$gp gpu "bench-$gp" "$part" "$PY" benchmarks/run.py --preset gpu-check \
      --out "$DETAILS/bench-$gp" --results-md "$DETAILS/RESULTS-$gp.md" --budget-s $(( part - 12 ))
    rc=$?
    tail -8 "$DETAILS/bench-$gp.log"
    if [ "$rc" -eq 0 ]; then record "bench-$gp" DONE "$(( $(date +%s) - s ))" "targets in RESULTS.md"
    else record "bench-$gp" FAIL "$(( $(date +%s) - s ))" "rc $rc; see details/bench-$gp.log"; fi
  done
}

# model_step NAME CMD...: a benchmark of run 2, its ratio line last.
model_step() {
  local name=$1 limit s rc
  shift
  limit=$(step_limit "$name")
  if [ "$limit" -lt 15 ]; then record "$name" SKIP 0 "no time left"; return; fi
  echo "== $name (limit ${limit}s): $*"
  s=$(date +%s)
  PYTHONUNBUFFERED=1 gpu "$name" "$limit" "$@"
  rc=$?
  tail -4 "$DETAILS/$name.log"
  if [ "$rc" -eq 0 ]; then record "$name" DONE "$(( $(date +%s) - s ))" "$(grep -v '^\s*$' "$DETAILS/$name.log" | tail -1)"
  else record "$name" FAIL "$(( $(date +%s) - s ))" "rc $rc; see details/$name.log"; fi
}

step_sanitizer() {
  local limit s rc note
  limit=$(step_limit sanitizer)
  if [ "$limit" -lt 20 ]; then record sanitizer SKIP 0 "no time left"; return; fi
  echo "== sanitizer: memcheck (limit ${limit}s)"
  mkdir -p "$DETAILS/sanitizer"
  s=$(date +%s)
  GPU_EXTRA_BUDGET_S=$(( limit - 8 )) OUT_EXTRA="$DETAILS/sanitizer" PYTHON="$PY" TOOLS=memcheck WORKLOAD_SIZE=small CUBLAS_GUARD_EXT_TESTING=1 \
    gpu sanitizer "$limit" bash benchmarks/gpu/gpu_extra_checks.sh
  rc=$?
  note=$(sed 's/^gpu_extra_checks: //' "$DETAILS/sanitizer/summary.txt" 2>/dev/null | paste -sd ';' -)
  case $rc in
    0) record sanitizer PASS "$(( $(date +%s) - s ))" "${note:-clean}" ;;
    1) record sanitizer FOUND "$(( $(date +%s) - s ))" "$note" ;;
    3) record sanitizer NORUN "$(( $(date +%s) - s ))" "the device refused compute-sanitizer: $note" ;;
    *) record sanitizer INCOMPL "$(( $(date +%s) - s ))" "rc $rc; $note" ;;
  esac
}

main() {
  echo "== gpu_check.sh --run $RUN $(date -u '+%Y-%m-%d %H:%M:%S UTC') in $ROOT; outputs in $OUT_DIR; stops at ${TOTAL_S}s"
  XDIST=()
  step_env
  local ok=1
  if [ "$RUN" = 1 ]; then
    if step_build; then
      # smoke: only its own files are collected (pytest's start is most of its minute)
      pytest_step smoke smoke "$("$PY" benchmarks/gpu/select_cuda_tests.py)" || ok=0
      pytest_step tests tests tests "${XDIST[@]}" || ok=0
      step_bench
    else
      ok=0
      record smoke SKIP 0 "no CUDA build"; record tests SKIP 0 "no CUDA build"
    fi
  else
    if step_build; then
      pytest_step watch-tests watch "$(echo tests/watch/test_*.py)" || ok=0
      model_step watch-bench "$PY" benchmarks/watch_bench.py --device cuda --model gpt2 --bf16 --no-dispatch-mode
      model_step guard-bench "$PY" benchmarks/training_guard_bench.py --device cuda --model gpt2 --bf16 --fused
      step_sanitizer
    else
      ok=0
    fi
  fi
  # The run's RESULTS.md section and its targets (run.py's format, gpu_results.py).
  timeout 60 "$PY" benchmarks/gpu/gpu_results.py --run "$RUN" --steps "$STEPS_FILE" --details "$DETAILS" \
    --command "$COMMAND" --wall-s "$(elapsed)" --results-md "$OUT_DIR/RESULTS.md" \
    --targets-txt "$DETAILS/targets.txt" >"$DETAILS/results.log" 2>&1 || tail -20 "$DETAILS/results.log"
  write_summary
  [ "$ok" = 1 ]
}

main 2>&1 | tee -a "$LOG"
STATUS=${PIPESTATUS[0]}
# Pack: everything else in one archive, so that at most MAX_FILES files come back.
tar -czf "$OUT_DIR/details.tar.gz" -C "$OUT_DIR" details 2>/dev/null && rm -rf "$DETAILS"
COUNT=$(find "$OUT_DIR" -mindepth 1 -maxdepth 1 | wc -l)
if [ "$COUNT" -gt "$MAX_FILES" ]; then
  echo "gpu_check.sh: $COUNT entries in $OUT_DIR, more than the $MAX_FILES the device tool brings back" | tee -a "$LOG"
  STATUS=1
fi
exit "$STATUS"
