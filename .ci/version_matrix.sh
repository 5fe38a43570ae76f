#!/usr/bin/env bash
# The torch versions users run: build the extension (CPU-only) against each torch of the
# matrix, run the demo, and run the fast suite, each in its own venv with Python 3.12.
# The project's own .venv (torch 2.13.0, Python 3.11) is `make test`'s; this adds the
# oldest and the newest torch we support.
#
# For each version V of MATRIX_TORCH_VERSIONS (default "2.11.0 2.15.0"):
#   * a venv .ci-cache/venv-torchV-pyX.Y, deleted when that version is done (a CUDA build
#     of torch is ~5 GB; .ci/disk.sh says why); CI_KEEP_VENVS=1 keeps it for reruns, and a
#     kept venv is rebuilt when its package list changes. torch 2.15 is above this machine's pip constraint (torch<=2.14.1),
#     so the venv's installs run with PIP_CONSTRAINT=/dev/null; every torch is pinned.
#   * a temporary copy of the tree (tracked + untracked-but-not-ignored files), installed
#     editable into that venv: for the versions of MATRIX_CUDA_VERSIONS (default "2.15.0") the
#     way a user's default install does it, a CUDA build since nvcc is present (for one arch,
#     MATRIX_CUDA_ARCH_LIST, default 9.0, to keep the stage short); for the others
#     CPU-only (CUBLAS_GUARD_EXT_FORCE_CPU=1; the PyPI wheels of these torches are CUDA
#     builds, and the full CUDA build is .ci/cuda_build_check.sh's job);
#   * `python -m cublas_guard_ext demo --steps 20 --no-bench`, then pytest on tests/ with
#     `-m "not slow"` minus MATRIX_IGNORE (files too slow for the stage's budget; they
#     run in `make test-slow`); for a CUDA build also tests/building/test_build.py whole (its slow tests
#     build the extension in subprocesses: the installed build and a JIT build into the
#     directory the parent process computes, the JIT key's stability); and the torch.compile
#     tests (MATRIX_COMPILE_TESTS), marked slow for `make test`'s budget but the tests most
#     likely to change from one torch release to the next.
#
# Environment:
#   MATRIX_TORCH_VERSIONS  torch versions to test (default: "2.11.0 2.15.0")
#   MATRIX_PYTHON          interpreter that creates the venvs (default: a Python 3.12 from
#                          PATH or pyenv; if none is found, python3, with a warning)
#   MATRIX_IGNORE          test files left out (default: see IGNORE below)
#   MATRIX_COMPILE_TESTS   slow-marked torch.compile tests run too (default: see COMPILE_TESTS below)
#   MATRIX_CUDA_VERSIONS   versions built with CUDA, as a user's default install (default: 2.15.0)
#   MATRIX_CUDA_ARCH_LIST  TORCH_CUDA_ARCH_LIST of those builds (default: 9.0)
#   CI_CACHE               cache directory (default: .ci-cache)
#   CI_KEEP_VENVS          1: keep the venvs between runs (default: delete each when done)
# Extra arguments are passed to pytest.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${CI_CACHE:-$ROOT/.ci-cache}
VERSIONS=${MATRIX_TORCH_VERSIONS:-2.11.0 2.15.0}
# Left out: the MiniLM files (they need sentence-transformers and the model wheel, which these
# venvs do not install; `make test-slow` runs them on 2.13) and tests/linear/test_properties.py: on torch
# 2.15 (2026-12-01) hypothesis reported its float32 gradient check as flaky (9.67e-5 vs a
# 1e-5 limit on a value of -0.0049, failing once and passing on replay); `make test` and the
# sanitizer stage run it.
IGNORE=${MATRIX_IGNORE-tests/linear/test_minilm.py tests/watch/test_watch_minilm.py tests/linear/test_properties.py}
# The torch.compile tests `make test` leaves to the slow tier (seconds each on 2 cores); Dynamo
# and Inductor change with every torch release, so the matrix runs them on each version.
COMPILE_TESTS=${MATRIX_COMPILE_TESTS-tests/linear/test_compile.py \
tests/linear/test_dtypes.py::test_torch_compile_per_dtype tests/linear/test_dtypes.py::test_autocast_under_compile \
tests/linear/test_modes.py::test_torch_compile_fullgraph_matches_eager \
tests/training/test_training_guard.py::test_compiled_model_is_guarded_and_the_replay_names_modules}
PACKAGES=(ninja pybind11 pytest hypothesis numpy 'setuptools>=77' wheel)
CUDA_VERSIONS=${MATRIX_CUDA_VERSIONS-2.15.0}
CUDA_ARCH_LIST=${MATRIX_CUDA_ARCH_LIST:-9.0}

die() { echo "version_matrix: $*" >&2; exit 1; }
# shellcheck source=disk.sh
source "$ROOT/.ci/disk.sh"

# ---- several versions: one child run each (every version is checked, also after a failure) ----
if [[ ${1:-} != --one ]] && (($(wc -w <<<"$VERSIONS") > 1)); then
  failed=() lines=()
  for version in $VERSIONS; do
    start=$(date +%s)
    if MATRIX_TORCH_VERSIONS=$version bash "$0" --one "$@"; then result=OK; else result=FAILED; failed+=("$version"); fi
    lines+=("$(printf '  torch %-10s %5ss  %s' "$version" $(($(date +%s) - start)) "$result")")
  done
  echo
  echo "version_matrix summary:"
  printf '%s\n' "${lines[@]}"
  ((${#failed[@]} == 0)) || die "failed on torch ${failed[*]}"
  echo "version_matrix: all OK (torch ${VERSIONS// /, })"
  exit 0
fi
[[ ${1:-} == --one ]] && shift

# ---- the interpreter ----------------------------------------------------------------
find_python312() {
  local candidate
  for candidate in "$(command -v python3.12 || true)" \
    "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
    if [[ -n $candidate && -x $candidate ]] && "$candidate" -c 'import venv, ensurepip' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}
PY_WARNING=
if [[ -n ${MATRIX_PYTHON:-} ]]; then
  BASE_PYTHON=$MATRIX_PYTHON
elif BASE_PYTHON=$(find_python312); then
  :
else
  BASE_PYTHON=python3
  PY_WARNING="no Python 3.12 found (PATH, pyenv): the matrix ran with $(python3 --version 2>&1)"
  echo "version_matrix: WARNING: $PY_WARNING" >&2
fi
PY_TAG=$("$BASE_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")') \
  || die "cannot run $BASE_PYTHON"
echo "version_matrix: torch ${VERSIONS// /, } with $BASE_PYTHON (Python $("$BASE_PYTHON" -c 'import platform; print(platform.python_version())'))"

# ---- timing -------------------------------------------------------------------------
RESULTS=()
STAGE_NAME= STAGE_START=
stage() {  # stage NAME: ends the previous stage (recording its time), starts NAME
  local now
  now=$(date +%s)
  if [[ -n $STAGE_NAME ]]; then
    RESULTS+=("$(printf '  %-40s %5ss' "$STAGE_NAME" $((now - STAGE_START)))")
  fi
  STAGE_NAME=$1 STAGE_START=$now
  [[ -n $1 ]] && echo && echo "=== version_matrix: $1"
  return 0
}
WORK=$(mktemp -d)
summary() {
  local rc=$?
  stage ""
  echo
  echo "version_matrix stage times:"
  printf '%s\n' "${RESULTS[@]}"
  [[ -n $PY_WARNING ]] && echo "  WARNING: $PY_WARNING"
  ((rc == 0)) && echo "version_matrix: OK (torch ${VERSIONS// /, }; Python $PY_TAG)" \
    || echo "version_matrix: FAILED (exit $rc)"
  rm -rf "$WORK"
  [[ -n ${venv:-} ]] && drop_venv "$venv"  # also after a failure: the next version needs the space
  return "$rc"
}
trap summary EXIT

copy_tree() {  # copy_tree DEST: what a commit of the working tree would hold
  mkdir -p "$1"
  if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
      | while IFS= read -r -d '' f; do if [[ -f $f ]]; then printf '%s\0' "$f"; fi; done \
      | tar --null -T - -cf -) | tar -xf - -C "$1"
  else
    tar -C "$ROOT" --exclude=.git --exclude=.venv --exclude=.ci-cache --exclude=build \
      --exclude='*.egg-info' --exclude='*.so' --exclude=__pycache__ -cf - . | tar -xf - -C "$1"
  fi
  if find "$1" -name '*.so' | grep -q .; then die "the copy holds a prebuilt .so"; fi
}

ignore_args=()
for f in $IGNORE; do ignore_args+=("--ignore=$f"); done

for version in $VERSIONS; do
  venv=$CACHE/venv-torch$version-py$PY_TAG
  vpy=$venv/bin/python
  spec="$BASE_PYTHON torch==$version ${PACKAGES[*]}"

  # ---- 1. the venv ------------------------------------------------------------------
  stage "torch $version: venv"
  if [[ -x $vpy && -f $venv/.spec && $(cat "$venv/.spec") == "$spec" ]]; then
    echo "reusing $venv"
  else
    rm -rf "$venv"
    disk_check "$CACHE" 9 "the torch $version venv"
    "$BASE_PYTHON" -m venv "$venv"
    # Pinned, and the machine's constraint (torch<=2.14.1) lifted for this venv only.
    PIP_CONSTRAINT=/dev/null "$vpy" -m pip install -qq "torch==$version" "${PACKAGES[@]}"
    echo "$spec" >"$venv/.spec"
  fi
  "$vpy" -c 'import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  "$vpy" - "$version" <<'PY'
import sys, torch
want = sys.argv[1]
if torch.__version__.split("+")[0] != want:
    sys.exit(f"the venv holds torch {torch.__version__}, not {want}")
PY

  # ---- 2. build (editable, in a copy of the tree): CUDA as a user's default, or CPU-only
  build_env=(CUBLAS_GUARD_EXT_FORCE_CPU=1) flavour=CPU-only
  if [[ " $CUDA_VERSIONS " == *" $version "* ]]; then
    build_env=(TORCH_CUDA_ARCH_LIST="$CUDA_ARCH_LIST") flavour=CUDA
  fi
  stage "torch $version: build ($flavour)"
  src=$WORK/src-$version
  copy_tree "$src"
  log=$CACHE/matrix-build-torch$version.log
  echo "full log: $log"
  "$vpy" -m pip uninstall --quiet --yes cublas_guard_ext >/dev/null 2>&1 || true
  if ! (cd "$src" && env "${build_env[@]}" PIP_CONSTRAINT=/dev/null \
    "$vpy" -m pip install --no-build-isolation --no-deps -v -e .) >"$log" 2>&1; then
    tail -n 60 "$log"
    die "torch $version: build failed (log: $log)"
  fi
  grep -m1 'cublas_guard_ext: building' "$log" || true
  grep -q "cublas_guard_ext: building $flavour extension" "$log" \
    || die "torch $version: setup.py did not build the $flavour extension"
  if grep -q 'the CUDA build failed' "$log"; then
    grep -m1 'the CUDA build failed' "$log"
    die "torch $version: the CUDA compile failed and setup.py built CPU-only (log: $log)"
  fi
  grep 'cublas_guard_ext build: done in' "$log" || true

  # ---- 3. the demo ------------------------------------------------------------------
  stage "torch $version: demo"
  mkdir -p "$WORK/elsewhere"
  (cd "$WORK/elsewhere" && "$vpy" - "$src" <<'PY'
import os, sys
import cublas_guard_ext
from cublas_guard_ext._native import loader
path = os.path.realpath(cublas_guard_ext.__file__)
assert path.startswith(os.path.realpath(sys.argv[1]) + os.sep), f"imported {path}, not the copy"
info = loader.info()
assert info.kind == "prebuilt", f"the built _C did not load (got a {info.kind} build)"
print("cublas_guard_ext from", path, "native:", info.kind, info.path)
PY
  )
  (cd "$WORK/elsewhere" && "$vpy" -m cublas_guard_ext demo --steps 20 --no-bench) \
    >"$CACHE/matrix-demo-torch$version.log" 2>&1 \
    || { tail -n 40 "$CACHE/matrix-demo-torch$version.log"; die "torch $version: the demo failed"; }
  tail -n 5 "$CACHE/matrix-demo-torch$version.log"

  # ---- 4. the fast suite ------------------------------------------------------------
  stage "torch $version: pytest (fast suite)"
  # A private TORCH_EXTENSIONS_DIR: nothing falls back to (or reuses) another JIT build.
  # --durations: the slowest tests, to keep the stage within its budget.
  (cd "$src" && TORCH_EXTENSIONS_DIR=$WORK/ext-$version \
    "$vpy" -m pytest -q -p no:cacheprovider -m "not slow" --durations=10 tests "${ignore_args[@]}" "$@")
  if [[ -n $COMPILE_TESTS ]]; then
    stage "torch $version: pytest (torch.compile tests)"
    # shellcheck disable=SC2086  # a list of test ids, split on purpose
    (cd "$src" && TORCH_EXTENSIONS_DIR=$WORK/ext-$version \
      "$vpy" -m pytest -q -p no:cacheprovider --durations=5 $COMPILE_TESTS "$@")
  fi
  if [[ $flavour == CUDA ]]; then
    # The slow build tests too: the installed CUDA build is used, and a JIT CUDA build in a
    # subprocess lands in the directory this process computes (one key however it started).
    stage "torch $version: pytest tests/building/test_build.py (CUDA build)"
    (cd "$src" && TORCH_EXTENSIONS_DIR=$WORK/ext-$version TORCH_CUDA_ARCH_LIST=$CUDA_ARCH_LIST \
      "$vpy" -m pytest -q -p no:cacheprovider --durations=5 tests/building/test_build.py "$@")
  fi
  rm -rf "$src" "$WORK/ext-$version"
  drop_venv "$venv"
done
