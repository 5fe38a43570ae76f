#!/usr/bin/env bash
# Prove the FULL CUDA build (CUDAExtension: nvcc + g++ compile, link) works on a
# machine with a CUDA toolkit but no GPU, as the project's one wheel (the stable core with its
# CUDA part, and the locked _C; left in CI_WHEEL_DIR for the version matrix), and that the
# result imports and passes the test suite, both tiers, and the fast tier on the core alone (the
# CUDA-only tests skip without a GPU; the CPU ones must pass with the CUDA build of torch and of
# the extension; the slow tier's compile and subprocess tests are the ones that see a torch other
# than the pinned one here). tests/tools, the tests of the dev tools (benchmarks/gpu's check, the
# seed plugin, the rank zygote), none of which the wheel holds, are left to make test-all.
#
# It never touches the project's .venv or the source tree's _C*.so:
#   * torch with CUDA goes into its own venv, .ci-cache/venv-cu, deleted at the end
#     (~5.5 GB; .ci/disk.sh says why) unless CI_KEEP_VENVS=1;
#   * the build runs in a temporary copy of the tree (tracked + untracked-but-not-
#     ignored files, i.e. what a commit of the working tree would hold), installed
#     NON-editable into that venv;
#   * the tests run from the copy against the INSTALLED package (checked, see below);
#   * then, in the same venv: doctor with a second libcublasLt on LD_LIBRARY_PATH, loaded
#     before torch (it must FAIL naming the folder and the entry, and pass without it); a CUDA
#     build with the system toolkit hidden and pip's toolkit (the `cuda-toolkit[nvcc,cccl]`
#     of torch's pin) installed, whose CUDA kernels must be registered; and with no toolkit at
#     all, a CPU-only build whose log names that pip command and whose first CUDA call raises
#     ExtensionBuildError (checked on the dispatcher's registry: there is no GPU).
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
#   STRAY_CUBLAS_SPEC  the wheel the stray libcublasLt comes from (default: nvidia-cublas==13.0.0.19)
#   CI_WHEEL_DIR       where the wheel is left (default: .ci-cache/dist)
#   CI_TEST_WORKERS    pytest-xdist workers for the installed package's whole suite (default: 2;
#                      0 runs it in one process)
# Extra arguments are passed to pytest. `--prepare-venv` alone only makes the venv (.ci/run starts
# it in the background while the tests run; this script then finds it ready: disk.sh's ensure_venv).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${CI_CACHE:-$ROOT/.ci-cache}
VENV=$CACHE/venv-cu
VPY=$VENV/bin/python
BASE_PYTHON=${BASE_PYTHON:-python3}
CUDA_TORCH_SPEC=${CUDA_TORCH_SPEC:-torch==2.14.1}
VENV_PACKAGES=("$CUDA_TORCH_SPEC" ninja pytest pytest-xdist==3.8.0 hypothesis numpy 'setuptools>=77' wheel)
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
# --prepare-venv (.ci/run, in the background while the tests run): make the venv, nothing else.
if [[ ${1:-} == --prepare-venv ]]; then
  export CI_PREFETCHING=1
  mkdir -p "$CACHE"
  ensure_venv "$VENV" "${VENV_PACKAGES[*]}" "$BASE_PYTHON" "${VENV_PACKAGES[@]}" >"$VENV.prefetch.log" 2>&1
  exit 0
fi
trap summary EXIT

[[ -x $CUDA_HOME/bin/nvcc && -f $CUDA_HOME/include/cuda_runtime.h ]] \
  || die "CUDA_HOME=$CUDA_HOME has no bin/nvcc + include/cuda_runtime.h"

# ---- 1. the CUDA torch venv ---------------------------------------------------------
stage "venv ($CUDA_TORCH_SPEC)"
ensure_venv "$VENV" "${VENV_PACKAGES[*]}" "$BASE_PYTHON" "${VENV_PACKAGES[@]}"
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

# ---- 3. the project's wheel, built once here, installed (non-editable) ----------------
# The wheel every later stage installs (the version matrix): the stable core (_core, and
# _core_cuda for CUDA 13) and the locked _C for this torch, from the copy (.ci/build_wheel.sh).
stage "wheel: build + install (CUDA)"
WHEEL_DIR=${CI_WHEEL_DIR:-$CACHE/dist}
LOG=$WHEEL_DIR/wheel-build.log
echo "CUDA_HOME=$CUDA_HOME TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST; full log: $LOG"
"$VPY" -m pip uninstall --quiet --yes cublas_guard_ext >/dev/null 2>&1 || true
(cd "$SRC" && bash .ci/build_wheel.sh "$VPY" "$WHEEL_DIR") || die "the wheel build failed (log: $LOG)"
grep -q 'cublas_guard_ext: building CUDA extension' "$LOG" \
  || die "setup.py did not choose the CUDA build (see the 'building' line above)"
# setup.py falls back to a CPU-only build when the CUDA compile fails: here that is a failure.
if grep -q 'the CUDA build failed' "$LOG"; then
  grep -m1 'the CUDA build failed' "$LOG"
  die "the CUDA compile failed and setup.py built CPU-only (log: $LOG)"
fi
WHEEL=$(ls "$WHEEL_DIR"/cublas_guard_ext-*-cp310-abi3-*.whl) || die "no cp310-abi3 wheel in $WHEEL_DIR"
"$VPY" - "$WHEEL" <<'PY' || die "the wheel lacks a part (above)"
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
want = ["_core.abi3.so", "_core_cuda.abi3.so", "_C.torch", "_core_cuda.cuda", "_csrc/ops.cpp"]
missing = [m for m in want if "cublas_guard_ext/" + m not in names]
sys.exit(f"the wheel lacks {missing}" if missing else 0)
PY
"$VPY" -m pip install --quiet --no-deps "$WHEEL"

# ---- 4. import check, outside the source copy ---------------------------------------
stage "import check"
mkdir -p "$WORK/elsewhere"
# From an empty directory, so the cwd on sys.path holds nothing importable.
(cd "$WORK/elsewhere" && "$VPY" - "$SRC" <<'PY'
import os, sys
import torch
import cublas_guard_ext
from cublas_guard_ext._native.loading import loader as _loader

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
# The same wheel's stable core alone: the CUDA core (_core_cuda, not _core) loads beside a
# CUDA torch and registers the CUDA kernels.
(cd "$WORK/elsewhere" && CUBLAS_GUARD_EXT_NATIVE=core "$VPY" - <<'PY'
import torch
from cublas_guard_ext._native.loading import loader
info = loader.info()
print("native:", info.library, info.kind, info.path, info.detail)
assert info.library == "core" and info.kind == "prebuilt" and info.path.endswith("_core_cuda.abi3.so"), info
assert torch._C._dispatch_has_kernel_for_dispatch_key("cublas_guard::linear", "CUDA"), "no CUDA kernel"
PY
)

# ---- 5. the test suite against the installed package --------------------------------
stage "pytest (installed package)"
# PYTHONSAFEPATH (Python >= 3.11): no Python the tests start puts its cwd or script
# dir on sys.path, so none can pick up the copy's package (which has no _C). A private
# TORCH_EXTENSIONS_DIR shows whether anything fell back to a JIT build.
# The workers (CI_TEST_WORKERS, pytest-xdist) are fresh processes: tests/conftest.py checks
# in each that it imported the installed package (CUBLAS_GUARD_EXT_TESTS_EXPECT_PACKAGE).
# CUBLAS_GUARD_EXT_TESTS_JIT_CPU_ONLY=1: the one test that compiles here, the JIT build from the wheel's
# shipped csrc/ (tests/building/test_build.py), proves the JIT machinery from an installed wheel
# under this CUDA torch with the C++ sources only. A CUDA JIT build from the installed wheel is
# what the version matrix's `python -m cublas_guard_ext build` runs on torch 2.15 (and checks
# it compiled CUDA kernels), and stage 3 compiled these .cu files for both archs: compiling them
# a third time here cost this stage ~3 minutes of ptxas (184 s of 536, 2026-12-06).
export PYTHONSAFEPATH=1 TORCH_EXTENSIONS_DIR=$WORK/torch_extensions CUBLAS_GUARD_EXT_TESTS_JIT_CPU_ONLY=1
CUBLAS_GUARD_EXT_TESTS_EXPECT_PACKAGE=$(cd "$WORK/elsewhere" && "$VPY" -c 'import importlib.util
print(importlib.util.find_spec("cublas_guard_ext").origin)')
export CUBLAS_GUARD_EXT_TESTS_EXPECT_PACKAGE
(cd "$SRC" && "$VPY" - -n "${CI_TEST_WORKERS:-2}" "$@" <<'PY'
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
# `import helpers`, but not the copy's root; and cublas_guard_ext is
# already in sys.modules anyway. Checked again after the run.
# The JIT-build test builds into its own TORCH_EXTENSIONS_DIR, from the csrc/ the wheel ships.
# tests/tools: the tests of the project's dev tools (benchmarks/gpu's check, the per-test seed
# plugin, the rank zygote), none of which the wheel holds; make test-all runs them.
rc = pytest.main(["-q", "-p", "no:cacheprovider", "--durations=15", "tests", "--ignore=tests/tools", *sys.argv[1:]])
assert os.path.realpath(sys.modules["cublas_guard_ext"].__file__) == path
sys.exit(rc)
PY
)
# The stable core alone (its CUDA part loaded), the fast tier: what a user of another torch runs.
stage "pytest (installed package, the stable core alone)"
(cd "$SRC" && CUBLAS_GUARD_EXT_NATIVE=core "$VPY" - -n "${CI_TEST_WORKERS:-2}" <<'PY'
import os, sys
cwd = os.path.realpath(os.getcwd())
sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != cwd]
import cublas_guard_ext
import pytest
from cublas_guard_ext._native.loading import loader
assert not os.path.realpath(cublas_guard_ext.__file__).startswith(cwd + os.sep)
assert loader.info().library == "core", loader.info()
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-m", "not slow", "tests", "--ignore=tests/tools", *sys.argv[1:]]))
PY
)
# Nothing may have fallen back to a JIT build here: a process that did imported some other copy
# of the package than the installed one (a tool putting the checkout first on sys.path once cost
# this stage a 3-minute CUDA build of the source copy, which has no library).
if [[ -d $TORCH_EXTENSIONS_DIR ]] && find "$TORCH_EXTENSIONS_DIR" -name '*.so' | grep -q .; then
  find "$TORCH_EXTENSIONS_DIR" -name '*.so'
  die "the tests JIT-built an extension in $TORCH_EXTENSIONS_DIR (above): a process imported the source copy, not the installed package"
fi

# ---- 6. doctor: a stray libcublasLt on LD_LIBRARY_PATH (pytorch #170676) ------------
stage "doctor: stray libcublasLt"
# A second libcublasLt.so.13 in a folder on LD_LIBRARY_PATH, loaded by name before torch
# (as a process that imports another CUDA package first does). It comes from another
# nvidia-cublas wheel (STRAY_CUBLAS_SPEC); if that cannot be downloaded, from a copy of the
# installed wheel's own file (same version, another folder: doctor must FAIL all the same).
STRAY=$WORK/stray-cuda/lib64
mkdir -p "$STRAY" "$WORK/wheel"
STRAY_CUBLAS_SPEC=${STRAY_CUBLAS_SPEC:-nvidia-cublas==13.0.0.19}
if timeout 300 "$VPY" -m pip download --quiet --no-deps -d "$WORK/wheel" "$STRAY_CUBLAS_SPEC" \
  && (cd "$WORK/wheel" && unzip -q -j -o ./*.whl '*/libcublasLt.so.*' -d "$STRAY"); then
  echo "stray copy: libcublasLt from $STRAY_CUBLAS_SPEC"
else
  "$VPY" - "$STRAY" <<'PY'
import glob, os, shutil, sys, sysconfig
[lt] = glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cu*", "lib", "libcublasLt.so.*"))[:1]
shutil.copy(lt, sys.argv[1])
print("stray copy: the installed", lt, "copied (no other wheel could be downloaded)")
PY
fi
rm -rf "$WORK/wheel"
ls -l "$STRAY"
(cd "$WORK/elsewhere" && LD_LIBRARY_PATH=$STRAY "$VPY" - "$STRAY" <<'PY'
import contextlib, ctypes, io, json, sys
stray = sys.argv[1]
ctypes.CDLL("libcublasLt.so.13")  # by name: LD_LIBRARY_PATH supplies it
import torch  # noqa: F401  (loads torch's pip libcublas, which finds libcublasLt by soname/RUNPATH)
from cublas_guard_ext.tools import doctor
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = doctor.main(as_json=True, probe=False)
report = json.loads(out.getvalue())
fails = [c for c in report["checks"] if c["status"] == "FAIL"]
print(doctor.render([doctor.Check(**c) for c in report["checks"]], report["environment"], report["next_steps"]))
rows = [c for c in fails if c["name"].startswith("loaded libraries") and stray in c["reason"]]
assert rc == 1 and rows, "doctor did not FAIL on the stray libcublasLt"
assert f"LD_LIBRARY_PATH's entry {stray}" in rows[0]["reason"], rows[0]
print("doctor FAILs as it should:", rows[0]["name"])
PY
)
(cd "$WORK/elsewhere" && env -u LD_LIBRARY_PATH "$VPY" - <<'PY'
import contextlib, io, json
from cublas_guard_ext.tools import doctor
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = doctor.main(as_json=True, probe=False)
report = json.loads(out.getvalue())
fails = [c for c in report["checks"] if c["status"] == "FAIL"]
assert rc == 0 and not fails, fails
print("without the stray folder: doctor passes;", report["summary"])
PY
)

# ---- 7. CUDA kernels from pip's toolkit alone ---------------------------------------
stage "pip toolkit: CUDA build"
# The system toolkit hidden (CUBLAS_GUARD_EXT_IGNORE_SYSTEM_CUDA=1, no CUDA_HOME, no nvcc on
# PATH); the toolkit comes from the one pip command the build itself names. One arch: the
# point is the toolchain, stage 3 built two.
TOOLKIT_SPEC=$("$VPY" - "$SRC" <<'PY'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("t", sys.argv[1] + "/cublas_guard_ext/_native/building/toolkit.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(module.pip_toolkit_spec())
PY
)
echo "pip install \"$TOOLKIT_SPEC\""
"$VPY" -m pip install --quiet "$TOOLKIT_SPEC"
NO_SYSTEM_PATH=$(tr ':' '\n' <<<"$PATH" | grep -v -e '^/usr/local/cuda' | paste -sd:)
PIP_LOG=$CACHE/cuda_build_pip_toolkit.log
"$VPY" -m pip uninstall --quiet --yes cublas_guard_ext >/dev/null 2>&1 || true
if ! (cd "$SRC" && env -u CUDA_HOME PATH="$NO_SYSTEM_PATH" CUBLAS_GUARD_EXT_IGNORE_SYSTEM_CUDA=1 \
  CUBLAS_GUARD_EXT_BUILD=locked TORCH_CUDA_ARCH_LIST=9.0 "$VPY" -m pip install --no-build-isolation --no-deps -v .) >"$PIP_LOG" 2>&1; then
  tail -n 60 "$PIP_LOG"
  die "the build with pip's toolkit failed (log: $PIP_LOG)"
fi
grep -m1 'cublas_guard_ext: building' "$PIP_LOG"
grep -q 'cublas_guard_ext: building CUDA extension.*/nvidia/cu[0-9]*' "$PIP_LOG" \
  || die "setup.py did not build CUDA with pip's toolkit (log: $PIP_LOG)"
if grep -q 'the CUDA build failed' "$PIP_LOG"; then die "the CUDA compile failed (log: $PIP_LOG)"; fi
(cd "$WORK/elsewhere" && "$VPY" - <<'PY'
import subprocess, torch
from cublas_guard_ext._native.loading import loader
info = loader.info()
assert info.kind == "prebuilt" and info.has_cuda_kernels, info
assert torch._C._dispatch_has_kernel_for_dispatch_key("cublas_guard::linear", "CUDA")
needed = subprocess.run(["readelf", "-d", info.path], capture_output=True, text=True).stdout
assert "libcudart.so.13" in needed, needed
print("CUDA kernels registered; the extension NEEDs libcudart.so.13:", info.path)
PY
)

# ---- 8. no toolkit at all: a CPU-only build that says so, and a typed error ---------
stage "no toolkit: typed error"
"$VPY" -m pip uninstall --quiet --yes nvidia-cuda-nvcc
NONE_LOG=$CACHE/cuda_build_no_toolkit.log
"$VPY" -m pip uninstall --quiet --yes cublas_guard_ext >/dev/null 2>&1 || true
(cd "$SRC" && env -u CUDA_HOME PATH="$NO_SYSTEM_PATH" CUBLAS_GUARD_EXT_IGNORE_SYSTEM_CUDA=1 \
  CUBLAS_GUARD_EXT_BUILD=locked "$VPY" -m pip install --no-build-isolation --no-deps -v .) >"$NONE_LOG" 2>&1 \
  || { tail -n 60 "$NONE_LOG"; die "the CPU-only build failed (log: $NONE_LOG)"; }
grep -m1 'cublas_guard_ext: building' "$NONE_LOG"
grep -q 'cublas_guard_ext: building CPU-only extension (WARNING: the extension has no CUDA kernels' "$NONE_LOG" \
  && grep -qF "pip install \"$TOOLKIT_SPEC\"" "$NONE_LOG" \
  || die "the install log does not say the kernels are missing with the pip command (log: $NONE_LOG)"
(cd "$WORK/elsewhere" && "$VPY" - "$TOOLKIT_SPEC" <<'PY'
import sys, torch
import cublas_guard_ext as cg
from cublas_guard_ext._native.machine import facts
assert not torch._C._dispatch_has_kernel_for_dispatch_key("cublas_guard::linear", "CUDA")
try:
    facts.first_cuda_use(torch.device("cuda", 0))  # what the first CUDA call runs first
except cg.ExtensionBuildError as err:
    assert err.missing == "CUDA kernels" and f'pip install "{sys.argv[1]}"' in str(err), str(err)
    print(str(err))
else:
    sys.exit("no ExtensionBuildError at the first CUDA call")
PY
)
