#!/usr/bin/env bash
# Compile-check every .cu file under csrc/ with nvcc, for sm_80 and sm_90, warnings as
# errors, with no GPU and no CUDA build of torch: the CPU torch wheel ships the
# ATen/cuda and c10/cuda headers, and the cuBLAS/cuSPARSE/cuSOLVER headers that
# ATen/cuda/CUDAContextLight.h includes come out of NVIDIA's pip wheels (cached).
# Nothing is linked and no object is kept (-o /dev/null); the full build is
# .ci/cuda_build_check.sh.
#
# Usage:
#   .ci/nvcc_check.sh               check every csrc/**/*.cu
#   .ci/nvcc_check.sh FILE|DIR...   check these .cu files (DIRs are searched)
#   .ci/nvcc_check.sh --self-test   prove the check fails on broken code: a copy of a
#                                   real .cu with a wrong cublasSgemm call, a kernel with
#                                   an unused variable (nvcc warning), a host function
#                                   with an unused parameter (gcc -Wextra warning); all
#                                   must FAIL, and the same small file without the
#                                   planted warnings must pass. Nothing in csrc/ changes.
#
# Environment:
#   PYTHON      a Python with torch (default: .venv/bin/python, made by `make venv`)
#   NVCC        nvcc to use (default: /usr/local/cuda/bin/nvcc if present, else PATH)
#   CI_CACHE    cache directory for the extracted headers (default: .ci-cache)
#
# Prints one line per file (name, seconds, OK/FAIL) and the compiler output of
# failures; exits non-zero if any file fails.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${CI_CACHE:-$ROOT/.ci-cache}
HEADERS_ROOT=$CACHE/cuda-headers
# The releases matching the CUDA 13 torch builds; only nvidia/cu13/include/* is kept.
HEADER_WHEELS=(nvidia-cublas==13.1.1.3 nvidia-cusparse==12.6.3.3 nvidia-cusolver==12.0.4.66)
HEADER_PREFIX=nvidia/cu13/include/

die() { echo "nvcc_check: $*" >&2; exit 2; }

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d'
  exit 0
fi

# ---- tools -------------------------------------------------------------------------
if [[ -z ${PYTHON:-} ]]; then
  if [[ ! -x $ROOT/.venv/bin/python ]]; then
    echo "nvcc_check: no .venv yet; creating it with 'make venv'"
    make -C "$ROOT" venv
  fi
  PYTHON=$ROOT/.venv/bin/python
fi
"$PYTHON" -c 'import torch' 2>/dev/null \
  || die "PYTHON=$PYTHON cannot import torch (use the project venv: make venv)"

if [[ -z ${NVCC:-} ]]; then
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then
    NVCC=/usr/local/cuda/bin/nvcc
  else
    NVCC=$(command -v nvcc) || die "nvcc not found (no /usr/local/cuda/bin/nvcc, none on PATH)"
  fi
fi

# ---- cuBLAS/cuSPARSE/cuSOLVER headers ------------------------------------------------
# Extracted once into the cache; the stamp records which wheels they came from.
ensure_headers() {
  local stamp=$HEADERS_ROOT/.complete want
  want="${HEADER_WHEELS[*]}"
  if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    return
  fi
  echo "nvcc_check: fetching CUDA library headers (${HEADER_WHEELS[*]})"
  rm -rf "$HEADERS_ROOT"
  mkdir -p "$HEADERS_ROOT/wheels"
  "$PYTHON" -m pip download --no-deps --quiet -d "$HEADERS_ROOT/wheels" "${HEADER_WHEELS[@]}"
  # Python's zipfile rather than unzip: one tool fewer on a fresh machine.
  "$PYTHON" - "$HEADERS_ROOT" "$HEADER_PREFIX" <<'PY'
import pathlib, sys, zipfile
root, prefix = pathlib.Path(sys.argv[1]), sys.argv[2]
for wheel in sorted((root / "wheels").glob("*.whl")):
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith(prefix) and not n.endswith("/")]
        if not names:
            sys.exit(f"{wheel.name}: nothing under {prefix}")
        zf.extractall(root, members=names)
        print(f"  {wheel.name}: {len(names)} headers")
PY
  rm -rf "$HEADERS_ROOT/wheels"  # ~770 MB of wheels for ~1 MB of headers
  [[ -f $HEADERS_ROOT/$HEADER_PREFIX/cublas_v2.h ]] || die "cublas_v2.h missing after extraction"
  echo "$want" >"$stamp"
}

# ---- flags -------------------------------------------------------------------------
# Every third-party include dir is -isystem: with -I, torch's own headers trip -Wextra.
build_flags() {
  local inc
  INCLUDE_FLAGS=()
  while IFS= read -r inc; do
    INCLUDE_FLAGS+=(-isystem "$inc")
  done < <("$PYTHON" -c '
import sysconfig
from torch.utils.cpp_extension import include_paths
print(*include_paths(), sysconfig.get_paths()["include"], sep="\n")')
  INCLUDE_FLAGS+=(-isystem "$HEADERS_ROOT/$HEADER_PREFIX")
  NVCC_FLAGS=(
    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
    -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror
    # The CPU wheel lacks c10/cuda/impl/cuda_cmake_macros.h.
    -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE
    # torch's own extension flags (torch.utils.cpp_extension COMMON_NVCC_FLAGS).
    -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
    -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
    --expt-relaxed-constexpr -std=c++20 -Xcompiler -fPIC
    "${INCLUDE_FLAGS[@]}"
  )
}

# check_file FILE CSRC_DIR [quiet]: one nvcc call (both archs); prints "name  seconds
# OK|FAIL". Returns 0 on OK, non-zero on FAIL; the compiler output of a failure is
# printed below the line (unless quiet), and kept in $LAST_LOG.
LAST_LOG=
check_file() {
  local file=$1 csrc=$2 quiet=${3:-} name start end rc=0
  name=${file#"$ROOT"/}
  LAST_LOG=$(mktemp)
  start=$(date +%s%N)
  "$NVCC" "${NVCC_FLAGS[@]}" -I "$csrc" -c "$file" -o /dev/null >"$LAST_LOG" 2>&1 || rc=$?
  end=$(date +%s%N)
  local secs
  secs=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  if ((rc == 0)); then
    printf '  %-50s %7ss  OK\n' "$name" "$secs"
  else
    printf '  %-50s %7ss  FAIL\n' "$name" "$secs"
    [[ -n $quiet ]] || sed 's/^/    | /' "$LAST_LOG" | head -n 60
  fi
  return "$rc"
}

list_cu() {  # .cu files under the given paths, sorted
  local p
  for p in "$@"; do
    if [[ -d $p ]]; then find "$p" -type f -name '*.cu'; else echo "$p"; fi
  done | LC_ALL=C sort
}

run_checks() {  # CSRC_DIR FILE...: all files, then a summary; non-zero if any failed
  local csrc=$1 failed=0 f
  shift
  for f in "$@"; do
    check_file "$f" "$csrc" || failed=$((failed + 1))
    rm -f "$LAST_LOG"
  done
  echo "nvcc_check: $(($# - failed))/$# OK"
  ((failed == 0))
}

# expect_fail DESCRIPTION PATTERN FILE CSRC_DIR: the file must FAIL, with PATTERN
# (an extended regex) in the compiler output, so it failed for the planted reason.
SELF_TEST_BAD=0
expect_fail() {
  local what=$1 pattern=$2 file=$3 csrc=$4
  echo "self-test: $what (must FAIL)"
  if check_file "$file" "$csrc" quiet; then
    echo "  -> WRONG: it compiled"; SELF_TEST_BAD=1
  elif ! grep -Eq "$pattern" "$LAST_LOG"; then
    sed 's/^/    | /' "$LAST_LOG" | head -n 60
    echo "  -> WRONG: failed, but not with /$pattern/"; SELF_TEST_BAD=1
  else
    echo "  -> failed as expected: $(grep -Em1 "$pattern" "$LAST_LOG" | sed -E 's/^[^ ]+ //')"  # minus "file(line):"
  fi
  rm -f "$LAST_LOG"
}

self_test() {
  local target
  tmp=$(mktemp -d)  # global: the EXIT trap runs after this function has returned
  trap 'rm -rf "$tmp"' EXIT
  cp -r "$ROOT/csrc" "$tmp/csrc"

  # 1. A real source (one that calls cuBLAS if any does) with cublasSgemm missing its
  #    last argument (ldc): 13 arguments instead of 14.
  target=$(grep -rl --include='*.cu' 'cublas' "$tmp/csrc" | LC_ALL=C sort | head -n 1 || true)
  [[ -n $target ]] || target=$(list_cu "$tmp/csrc" | head -n 1)
  [[ -n $target ]] || die "self-test: no .cu file under csrc/"
  cat >>"$target" <<'CU'

// planted by nvcc_check.sh --self-test
#include <cublas_v2.h>
void nvcc_check_planted_error(cublasHandle_t handle, const float* a, float* c) {
  const float one = 1.0f;
  cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, a, 1, a, 1, &one, c);
}
CU
  expect_fail "copy of ${target#"$tmp"/} with a 13-argument cublasSgemm call" \
    'too few arguments' "$target" "$tmp/csrc"

  # 2.-4. Small files: planted warnings must fail (-Werror all-warnings for nvcc's own
  #    front end, -Xcompiler -Werror for gcc's -Wextra), the clean twin must pass.
  local small=$tmp/small.cu
  printf '%s\n' '#include <cuda_runtime.h>' \
    '__global__ void planted(float* p) { int unused_variable = 0; p[0] = 1.0f; }' >"$small"
  expect_fail "kernel with an unused variable (nvcc warning)" 'unused_variable' "$small" "$tmp/csrc"
  printf '%s\n' '#include <cuda_runtime.h>' \
    'int planted_host(int unused_parameter) { return 0; }' >"$small"
  expect_fail "host function with an unused parameter (gcc -Wextra)" 'unused_parameter' \
    "$small" "$tmp/csrc"
  printf '%s\n' '#include <cuda_runtime.h>' \
    '__global__ void clean(float* p) { p[0] = 1.0f; }' \
    'int clean_host(int x) { return x; }' >"$small"
  echo "self-test: the same small file without the planted warnings (must be OK)"
  if check_file "$small" "$tmp/csrc"; then
    echo "  -> compiled as expected"
  else
    echo "  -> WRONG: the clean file failed"; SELF_TEST_BAD=1
  fi
  rm -f "$LAST_LOG"

  if ((SELF_TEST_BAD)); then
    echo "nvcc_check self-test: FAILED (the check would let broken code through)"
    return 1
  fi
  echo "nvcc_check self-test: OK (broken code is rejected)"
}

# ---- main --------------------------------------------------------------------------
echo "nvcc_check: $NVCC ($("$NVCC" --version | grep -o "release [0-9.]*")), torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
ensure_headers
build_flags

if [[ ${1:-} == --self-test ]]; then
  self_test
  exit
fi

mapfile -t FILES < <(list_cu "${@:-$ROOT/csrc}")
((${#FILES[@]} > 0)) || die "no .cu files found under ${*:-csrc/}: nothing was checked"
run_checks "$ROOT/csrc" "${FILES[@]}"
