#!/usr/bin/env bash
# Compile-check the CUDA sources with no GPU and no CUDA build of torch, warnings as
# errors, in both builds of the core (csrc/core/tensor_api.h says why there are two):
#   aten    every csrc/**/*.cu with nvcc for sm_80 and sm_90, and the .cpp files of
#           sources.py's CUDA_SOURCES with g++: the version-locked library's flags
#           (-DCUBLAS_GUARD_WITH_CUDA, ATen, c10/cuda);
#   stable  sources.py's CORE_CUDA_SOURCES (.cu with nvcc, .cpp with g++) with the
#           stable core's flags: -DCUBLAS_GUARD_STABLE -DTORCH_TARGET_VERSION (2.10)
#           -DUSE_CUDA -DCUBLAS_GUARD_WITH_CUDA, C++17, the limited Python API; torch's
#           c10/macros/Macros.h refuses to be included under TORCH_TARGET_VERSION, so
#           an ATen or c10 header there fails the check. One arch (sm_90): the
#           kernels are the same text in both builds and the aten pass builds them
#           for both archs; only host code differs.
#   unity   (every-file runs only) the C++ of each CUDA build as the build compiles it:
#           one translation unit per layer (cublas_guard_ext/_native/building/unity_build.py), in
#           its build's flags (aten: the core's and the locked library's; stable: the core's).
# The CPU torch wheel ships the ATen/cuda, c10/cuda and stable headers; the
# cuBLAS/cuSPARSE/cuSOLVER headers come out of NVIDIA's pip wheels (cached).
# Nothing is linked and no object is kept (-o /dev/null); the full build is
# .ci/cuda_build_check.sh.
#
# Usage:
#   .ci/nvcc_check.sh               check every file, both builds
#   .ci/nvcc_check.sh FILE|DIR...   check these files (DIRs are searched for .cu): the
#                                   aten build for a .cu or a CUDA_SOURCES .cpp, the
#                                   stable build for a CORE_CUDA_SOURCES file
#   .ci/nvcc_check.sh --self-test   prove the check fails on broken code: a copy of a
#                                   real .cu with a wrong cublasSgemm call, a kernel with
#                                   an unused variable (nvcc warning), a host function
#                                   with an unused parameter (gcc -Wextra warning), a
#                                   copy of a core .cu that includes an ATen header
#                                   (stable build), a copy of a core .cpp with an unused
#                                   parameter (g++, stable build); all must FAIL, and the
#                                   same small file without the planted warnings must
#                                   pass. Nothing in csrc/ changes.
#
# Environment:
#   PYTHON      a Python with torch (default: .venv/bin/python, made by `make venv`)
#   NVCC        nvcc to use (default: /usr/local/cuda/bin/nvcc if present, else PATH)
#   CXX         the host compiler for .cpp files (default: g++)
#   CI_CACHE    cache directory for the extracted headers (default: .ci-cache)
#   JOBS        compiles at once (default: the number of CPUs)
#
# Prints one line per file and build (name, build, seconds, OK/FAIL) and the compiler
# output of failures; exits non-zero if any file fails.
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

CXX=${CXX:-g++}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 1)}

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
  local inc torch_include python_include cuda_include
  INCLUDE_FLAGS=()
  while IFS= read -r inc; do
    INCLUDE_FLAGS+=(-isystem "$inc")
  done < <("$PYTHON" -c '
import sysconfig
from torch.utils.cpp_extension import include_paths
print(*include_paths(), sysconfig.get_paths()["include"], sep="\n")')
  INCLUDE_FLAGS+=(-isystem "$HEADERS_ROOT/$HEADER_PREFIX")
  { read -r torch_include; read -r python_include; } < <("$PYTHON" -c '
import sysconfig
from torch.utils.cpp_extension import include_paths
print(include_paths()[0], sysconfig.get_paths()["include"], sep="\n")')
  cuda_include=$(cd "$(dirname "$NVCC")/.." && pwd)/include  # nvcc searches it by itself; g++ does not
  # torch's own extension flags (torch.utils.cpp_extension COMMON_NVCC_FLAGS).
  local common_nvcc=(
    -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror
    -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
    -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
    --expt-relaxed-constexpr -Xcompiler -fPIC
  )
  local common_cxx=(-Wall -Wextra -Werror -fPIC)
  # The CPU wheel lacks c10/cuda/impl/cuda_cmake_macros.h.
  local aten_defines=(-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE -DCUBLAS_GUARD_WITH_CUDA)
  ATEN_NVCC_FLAGS=(
    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -std=c++20
    "${common_nvcc[@]}" "${aten_defines[@]}" "${INCLUDE_FLAGS[@]}"
  )
  ATEN_CXX_FLAGS=(-std=c++20 "${common_cxx[@]}" "${aten_defines[@]}" "${INCLUDE_FLAGS[@]}"
    -isystem "$cuda_include")
  # The stable core: only torch/csrc/stable, torch/headeronly and the AOTI shims
  # (include_paths()[0] is torch/include; nothing else of torch's is searched).
  local stable_defines=(-DCUBLAS_GUARD_STABLE -DTORCH_TARGET_VERSION=0x020a000000000000 -DUSE_CUDA
    -DCUBLAS_GUARD_WITH_CUDA)
  local stable_includes=(-isystem "$torch_include" -isystem "$HEADERS_ROOT/$HEADER_PREFIX")
  STABLE_NVCC_FLAGS=(
    -gencode arch=compute_90,code=sm_90 -std=c++17 -Xcompiler -fvisibility=hidden
    "${common_nvcc[@]}" "${stable_defines[@]}" "${stable_includes[@]}"
  )
  STABLE_CXX_FLAGS=(-std=c++17 -fvisibility=hidden "${common_cxx[@]}" "${stable_defines[@]}"
    -DPy_LIMITED_API=0x030a0000 "${stable_includes[@]}" -isystem "$cuda_include"
    -isystem "$python_include")
}

# The CUDA source lists of cublas_guard_ext/_native/building/sources.py (paths relative to csrc/):
# CUDA_SOURCES (the locked library's) and CORE_CUDA_SOURCES (also the stable core's).
read_source_lists() {
  mapfile -t CUDA_LIST < <("$PYTHON" -c '
import runpy, sys
print(*runpy.run_path(sys.argv[1])["CUDA_SOURCES"], sep="\n")' "$ROOT/cublas_guard_ext/_native/building/sources.py")
  mapfile -t CORE_CUDA_LIST < <("$PYTHON" -c '
import runpy, sys
print(*runpy.run_path(sys.argv[1])["CORE_CUDA_SOURCES"], sep="\n")' "$ROOT/cublas_guard_ext/_native/building/sources.py")
  ((${#CORE_CUDA_LIST[@]} > 0)) || die "sources.py lists no CORE_CUDA_SOURCES"
}

# check_file FILE CSRC_DIR BUILD [quiet]: one compile of FILE in BUILD (aten|stable):
# nvcc for a .cu (both archs for aten, one for stable), $CXX for a .cpp; prints "name
# build seconds OK|FAIL". Returns 0 on OK, non-zero on FAIL; the compiler output of a
# failure is printed below the line (unless quiet), and kept in $LAST_LOG.
LAST_LOG=
check_file() {
  local file=$1 csrc=$2 build=$3 quiet=${4:-} name start end rc=0
  local -a cmd
  name=${file#"$ROOT"/}
  case $build:$file in
    aten:*.cu) cmd=("$NVCC" "${ATEN_NVCC_FLAGS[@]}") ;;
    aten:*) cmd=("$CXX" "${ATEN_CXX_FLAGS[@]}") ;;
    stable:*.cu) cmd=("$NVCC" "${STABLE_NVCC_FLAGS[@]}") ;;
    stable:*) cmd=("$CXX" "${STABLE_CXX_FLAGS[@]}") ;;
  esac
  LAST_LOG=$(mktemp)
  start=$(date +%s%N)
  "${cmd[@]}" -I "$csrc" -c "$file" -o /dev/null >"$LAST_LOG" 2>&1 || rc=$?
  end=$(date +%s%N)
  local secs
  secs=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  if ((rc == 0)); then
    printf '  %-44s %-6s %7ss  OK\n' "$name" "$build" "$secs"
  else
    printf '  %-44s %-6s %7ss  FAIL\n' "$name" "$build" "$secs"
    [[ -n $quiet ]] || sed 's/^/    | /' "$LAST_LOG" | head -n 60
  fi
  return "$rc"
}

list_cu() {  # .cu files under the given paths (files as given), absolute, sorted
  local p
  for p in "$@"; do
    if [[ -d $p ]]; then find "$(realpath "$p")" -type f -name '*.cu'; else realpath -m "$p"; fi
  done | LC_ALL=C sort -u
}

in_list() {  # NAME ITEM...: whether NAME is one of the items
  local name=$1 item
  shift
  for item in "$@"; do [[ $item == "$name" ]] && return 0; done
  return 1
}

# unity_checks DIR: "BUILD FILE" lines for the unity groups of the two CUDA builds
# (cublas_guard_ext/_native/building/unity_build.py), generated into DIR: the C++ of the locked CUDA
# library (aten) and of the CUDA core (stable) as the full CUDA build compiles it, one
# translation unit per layer, so two files of a group that clash fail here, not on a GPU machine.
unity_checks() {
  local dir=$1 build list file
  for build in aten stable; do
    [[ $build == aten ]] && list='CPU_SOURCES"] + s["CUDA_SOURCES' || list='CORE_CPU_SOURCES"] + s["CORE_CUDA_SOURCES'
    "$PYTHON" "$ROOT/cublas_guard_ext/_native/building/unity_build.py" "$dir/$build" $("$PYTHON" -c '
import runpy, sys
s = runpy.run_path(sys.argv[1])
print(*(sys.argv[2] + "/" + f for f in s["'"$list"'"]))' "$ROOT/cublas_guard_ext/_native/building/sources.py" "$ROOT/csrc") \
      | while read -r file; do if [[ $(basename "$file") == unity_* ]]; then echo "$build $file"; fi; done
  done
}

# plan_checks FILE...: "BUILD FILE" lines, the builds each file is checked in (every
# aten compile first).
plan_checks() {
  local f
  for f in "$@"; do
    if [[ $f == *.cu ]] || in_list "${f#"$ROOT"/csrc/}" "${CUDA_LIST[@]}"; then echo "aten $f"; fi
  done
  for f in "$@"; do
    if in_list "${f#"$ROOT"/csrc/}" "${CORE_CUDA_LIST[@]}"; then echo "stable $f"; fi
  done
}

# run_checks CSRC_DIR "BUILD FILE"...: every compile (JOBS at once), its lines printed
# in the order given, then a summary; non-zero if any failed.
run_checks() {
  local csrc=$1 failed=0 i=0 build file out
  shift
  out=$(mktemp -d)
  for item in "$@"; do
    build=${item%% *}
    file=${item#* }
    while (($(jobs -rp | wc -l) >= JOBS)); do wait -n || true; done
    (
      rc=0
      check_file "$file" "$csrc" "$build" >"$out/$i.out" 2>&1 || rc=$?
      rm -f "$LAST_LOG"
      echo "$rc" >"$out/$i.rc"
    ) &
    i=$((i + 1))
  done
  wait
  for ((i = 0; i < $#; i++)); do
    cat "$out/$i.out"
    [[ $(cat "$out/$i.rc" 2>/dev/null) == 0 ]] || failed=$((failed + 1))
  done
  rm -rf "$out"
  echo "nvcc_check: $(($# - failed))/$# OK"
  ((failed == 0))
}

# expect_fail DESCRIPTION PATTERN FILE CSRC_DIR [BUILD]: the file must FAIL (in BUILD,
# default aten), with PATTERN (an extended regex) in the compiler output, so it failed
# for the planted reason.
SELF_TEST_BAD=0
expect_fail() {
  local what=$1 pattern=$2 file=$3 csrc=$4 build=${5:-aten}
  echo "self-test: $what (must FAIL)"
  if check_file "$file" "$csrc" "$build" quiet; then
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

  # 5. The stable build: a copy of a core .cu that includes an ATen/c10 header must
  #    fail (torch's own #error under TORCH_TARGET_VERSION), and a copy of a core .cpp
  #    with an unused parameter must fail ($CXX with -Wextra -Werror).
  target=
  for f in "${CORE_CUDA_LIST[@]}"; do [[ -z $target && $f == *.cu ]] && target=$tmp/csrc/$f; done
  [[ -n $target ]] || die "self-test: no .cu in CORE_CUDA_SOURCES"
  printf '\n// planted by nvcc_check.sh --self-test\n#include <c10/util/Exception.h>\n' >>"$target"
  expect_fail "copy of ${target#"$tmp"/} including an ATen/c10 header (stable build)" \
    'should not be included' "$target" "$tmp/csrc" stable
  target=
  for f in "${CORE_CUDA_LIST[@]}"; do [[ -z $target && $f == *_stable.cpp ]] && target=$tmp/csrc/$f; done
  [[ -n $target ]] || die "self-test: no *_stable.cpp in CORE_CUDA_SOURCES"
  printf '\n// planted by nvcc_check.sh --self-test\nint planted_host(int unused_parameter) { return 0; }\n' \
    >>"$target"
  expect_fail "copy of ${target#"$tmp"/} with an unused parameter (stable build, $CXX -Wextra)" \
    'unused_parameter' "$target" "$tmp/csrc" stable

  echo "self-test: the same small file without the planted warnings (must be OK)"
  if check_file "$small" "$tmp/csrc" aten; then
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
read_source_lists

if [[ ${1:-} == --self-test ]]; then
  self_test
  exit
fi

if (($# > 0)); then
  mapfile -t FILES < <(list_cu "$@")
else
  mapfile -t FILES < <(list_cu "$ROOT/csrc" "${CUDA_LIST[@]/#/$ROOT/csrc/}")
fi
mapfile -t CHECKS < <(plan_checks "${FILES[@]}")
((${#CHECKS[@]} > 0)) || die "nothing to check in ${*:-csrc/} (a .cu, or a .cpp of sources.py's CUDA lists)"
if (($# == 0)); then
  UNITY_DIR=$(mktemp -d)
  trap 'rm -rf "$UNITY_DIR"' EXIT
  mapfile -t UNITY < <(unity_checks "$UNITY_DIR")
  ((${#UNITY[@]} == 3)) || die "expected 3 unity groups (aten core, aten locked, stable core), got ${#UNITY[@]}"
  CHECKS=("${UNITY[@]}" "${CHECKS[@]}")
fi
run_checks "$ROOT/csrc" "${CHECKS[@]}"
