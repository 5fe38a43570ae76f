#!/usr/bin/env bash
# Prove the FULL CUDA build (CUDAExtension: nvcc + g++ compile, link) works on a
# machine with a CUDA toolkit but no GPU, and that the result imports and passes the
# test suite (the CUDA-only tests skip without a GPU; the CPU ones must pass with
# the CUDA build of torch and of the extension).
#
# It never touches the project's .venv or the source tree's _C*.so:
#   * torch with CUDA goes into its own venv, .ci-cache/venv-cu, deleted at the end
#     (~5.5 GB; .ci/disk.sh says why) unless CI_KEEP_VENVS=1;
#   * the build runs in a temporary copy of the tree (tracked + untracked-but-not-
#     ignored files, i.e. what a commit of the working tree would hold), installed
#     NON-editable into that venv;
#   * the tests run from the copy against the INSTALLED package (checked, see below).
#
# Environment:
#   BASE_PYTHON        interpreter that creates the venv (default: python3)
#   CUDA_TORCH_SPEC    the CUDA torch to test with (default: torch==2.14.1, a cu130 build)
#   CUDA_HOME          toolkit root (default: /usr/local/cuda; torch's own guess is
#                      /usr/local here because nvcc on PATH is a wrapper script)
#   TORCH_CUDA_ARCH_LIST  archs to build (default: "8.0;9.0"; with no GPU visible
#                      the build needs a list, and two archs keep it short)
#   CI_CACHE           cache directory (default: .ci-cache)
#   CI_KEEP_VENVS      1: keep the venv between runs (default: delete it at the end)
# Extra arguments are passed to pytest.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${CI_CACHE:-$ROOT/.ci-cache}
VENV=$CACHE/venv-cu
VPY=$VENV/bin/python
BASE_PYTHON=${BASE_PYTHON:-python3}
CUDA_TORCH_SPEC=${CUDA_TORCH_SPEC:-torch==2.14.1}
VENV_PACKAGES=("$CUDA_TORCH_SPEC" ninja pytest hypothesis numpy 'setuptools>=77' wheel)
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0}

die() { echo "cuda_build_check: $*" >&2; exit 1; }
# shellcheck source=disk.sh
source "$ROOT/.ci/disk.sh"

# ---- stage timing ------------------------------------------------------------------
STAGES=()
STAGE_NAME= STAGE_START=
stage() {  # stage NAME: ends the previous stage (recording its time), starts NAME
  local now
  now=$(date +%s)
  if [[ -n $STAGE_NAME ]]; then
    STAGES+=("$(printf '  %-34s %5ss' "$STAGE_NAME" $((now - STAGE_START)))")
  fi
  STAGE_NAME=$1 STAGE_START=$now
  [[ -n $1 ]] && echo && echo "=== cuda_build_check: $1"
  return 0
}
summary() {
  local rc=$?
  stage ""
  echo
  echo "cuda_build_check stage times:"
  printf '%s\n' "${STAGES[@]}"
  ((rc == 0)) && echo "cuda_build_check: OK" || echo "cuda_build_check: FAILED (exit $rc)"
  [[ -n ${WORK:-} ]] && rm -rf "$WORK"
  drop_venv "$VENV"
  return "$rc"
}
trap summary EXIT

[[ -x $CUDA_HOME/bin/nvcc && -f $CUDA_HOME/include/cuda_runtime.h ]] \
  || die "CUDA_HOME=$CUDA_HOME has no bin/nvcc + include/cuda_runtime.h"

# ---- 1. the CUDA torch venv ---------------------------------------------------------
stage "venv ($CUDA_TORCH_SPEC)"
spec="${VENV_PACKAGES[*]}"
if [[ -x $VPY && -f $VENV/.spec && $(cat "$VENV/.spec") == "$spec" ]]; then
  echo "reusing $VENV"
else
  rm -rf "$VENV"
  disk_check "$CACHE" 9 "the CUDA torch venv"
  "$BASE_PYTHON" -m venv "$VENV"
  "$VPY" -m pip install --quiet "${VENV_PACKAGES[@]}"
  echo "$spec" >"$VENV/.spec"
fi
"$VPY" -c 'import torch, sys
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu:", torch.cuda.is_available())
sys.exit(0 if torch.version.cuda else "this torch is a CPU-only build: no CUDA build to check")'

# ---- 2. a clean copy of the tree ----------------------------------------------------
stage "copy source tree"
WORK=$(mktemp -d)
SRC=$WORK/src
mkdir -p "$SRC"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # Tracked and untracked-but-not-ignored files that exist: no .venv, build/, *.so.
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do if [[ -f $f ]]; then printf '%s\0' "$f"; fi; done \
    | tar --null -T - -cf -) | tar -xf - -C "$SRC"
else
  tar -C "$ROOT" --exclude=.git --exclude=.venv --exclude=.ci-cache --exclude=build \
    --exclude='*.egg-info' --exclude='*.so' --exclude=__pycache__ -cf - . | tar -xf - -C "$SRC"
fi
echo "$(find "$SRC" -type f | wc -l) files in $SRC"
if find "$SRC" -name '*.so' | grep -q .; then die "the copy holds a prebuilt .so"; fi

# ---- 3. build and install (non-editable) --------------------------------------------
stage "build + install (CUDAExtension)"
LOG=$CACHE/cuda_build.log
echo "CUDA_HOME=$CUDA_HOME TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST; full log: $LOG"
"$VPY" -m pip uninstall --quiet --yes cublas_guard_ext >/dev/null 2>&1 || true
if ! (cd "$SRC" && "$VPY" -m pip install --no-build-isolation --no-deps -v .) >"$LOG" 2>&1; then
  tail -n 60 "$LOG"
  die "build failed (log: $LOG)"
fi
grep -m1 'cublas_guard_ext: building' "$LOG" || true
grep -q 'cublas_guard_ext: building CUDA extension' "$LOG" \
  || die "setup.py did not choose the CUDA build (see the 'building' line above)"
# setup.py falls back to a CPU-only build when the CUDA compile fails: here that is a failure.
if grep -q 'the CUDA build failed' "$LOG"; then
  grep -m1 'the CUDA build failed' "$LOG"
  die "the CUDA compile failed and setup.py built CPU-only (log: $LOG)"
fi

# ---- 4. import check, outside the source copy ---------------------------------------
stage "import check"
mkdir -p "$WORK/elsewhere"
# From an empty directory, so the cwd on sys.path holds nothing importable.
(cd "$WORK/elsewhere" && "$VPY" - "$SRC" <<'PY'
import os, sys
import torch
import cublas_guard_ext
from cublas_guard_ext._native import loader as _loader

src = os.path.realpath(sys.argv[1])
path = os.path.realpath(cublas_guard_ext.__file__)
info = _loader.info()
print("cublas_guard_ext from", path)
print("native:", info.kind, info.path, "cuda kernels:", info.has_cuda_kernels)
assert not path.startswith(src + os.sep), "imported the source copy, not the installed package"
assert info.kind == "prebuilt", f"the installed _C did not load (got a {info.kind} build)"
assert torch._C._dispatch_has_kernel_for_dispatch_key("cublas_guard::linear", "CUDA"), \
    "no CUDA kernel registered for cublas_guard::linear"
print("torch.cuda.is_available():", torch.cuda.is_available())
PY
)

# ---- 5. the test suite against the installed package --------------------------------
stage "pytest (installed package)"
# PYTHONSAFEPATH (Python >= 3.11): no Python the tests start puts its cwd or script
# dir on sys.path, so none can pick up the copy's package (which has no _C). A private
# TORCH_EXTENSIONS_DIR shows whether anything fell back to a JIT build.
export PYTHONSAFEPATH=1 TORCH_EXTENSIONS_DIR=$WORK/torch_extensions
(cd "$SRC" && "$VPY" - "$@" <<'PY'
import os, sys
cwd = os.path.realpath(os.getcwd())
sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != cwd]  # '' is the cwd
import cublas_guard_ext  # first, so every test gets this module
import pytest

path = os.path.realpath(cublas_guard_ext.__file__)
print("testing cublas_guard_ext from", path)
if path.startswith(cwd + os.sep):
    sys.exit("imported the source copy, not the installed package")
# pytest's default import mode puts tests/ (no __init__.py) on sys.path, for
# `from conftest import ...`, but not the copy's root; and cublas_guard_ext is
# already in sys.modules anyway. Checked again after the run.
# The JIT-build tests skip themselves here: an installed wheel has no csrc/ beside it.
rc = pytest.main(["-q", "-p", "no:cacheprovider", "tests", *sys.argv[1:]])
assert os.path.realpath(sys.modules["cublas_guard_ext"].__file__) == path
sys.exit(rc)
PY
)
if [[ -d $TORCH_EXTENSIONS_DIR ]] && find "$TORCH_EXTENSIONS_DIR" -name '*.so' | grep -q .; then
  echo "note: the tests JIT-built an extension (in $TORCH_EXTENSIONS_DIR):"
  find "$TORCH_EXTENSIONS_DIR" -name '*.so'
fi
