"""Loading the native ops: a prebuilt ``_C`` if installed, else a JIT build.

The JIT build compiles the same sources with the same flags as ``setup.py``
(see ``build.py``) through ``torch.utils.cpp_extension.load`` and ninja, into
``TORCH_EXTENSIONS_DIR`` (torch's default cache when unset) / a directory named
by ``build.jit_name``: keyed by the environment's prefix, torch and its CUDA, the
Python ABI and the flags, so two environments never rebuild over each other.
The build prints its progress to stderr (file, n of N, seconds).

This layer sits on errors/ alone (docs/architecture.md): it imports nothing
above it. The ``ExtensionBuildError`` it raises when a build cannot work is
written in errors/, like every user-facing message, and imported late, in the
three functions that raise it.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import sysconfig
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from . import build as _build

_lock = threading.Lock()


@dataclass(frozen=True)
class NativeInfo:
    """How the native library was obtained."""

    kind: str  # "prebuilt" | "jit"
    path: str
    has_cuda_kernels: bool
    detail: str


_info: NativeInfo | None = None


def _ops_registered() -> bool:
    return hasattr(torch.ops, "cublas_guard") and hasattr(torch.ops.cublas_guard, "linear")


def _has_cuda_kernels() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("cublas_guard::linear", "CUDA")


def _try_prebuilt() -> NativeInfo | None:
    try:
        module = importlib.import_module("cublas_guard_ext._C")
    except ModuleNotFoundError:
        return None
    except ImportError as exc:  # present but unloadable: usually built against another torch
        warnings.warn(
            f"cublas_guard_ext: the installed _C failed to load ({exc}); it was probably built "
            f"against another torch than {torch.__version__}. Falling back to a JIT build; "
            "reinstall with `pip install --no-build-isolation -e .` to fix it for good.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return NativeInfo("prebuilt", str(module.__file__), _has_cuda_kernels(), "installed _C")


def _preflight(plan: _build.BuildPlan) -> None:
    """Say exactly what is missing before a compiler says it less clearly."""
    from ..errors import ExtensionBuildError  # late: see the module docstring

    missing = [s for s in plan.sources if not Path(s).exists()]
    if missing:
        raise ExtensionBuildError(
            missing="sources",
            detail=f"{len(missing)} source file(s) not found, e.g. {missing[0]}",
            fix="install from a source checkout (`pip install --no-build-isolation -e .`) "
            "or a wheel with the prebuilt _C",
        )
    if shutil.which("ninja") is None:
        raise ExtensionBuildError(
            missing="ninja",
            detail="the JIT build needs the ninja build tool",
            fix="pip install ninja",
        )
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise ExtensionBuildError(
            missing="C++ compiler",
            detail=f"`{compiler}` not found on PATH",
            fix="install g++ (Debian/Ubuntu: apt install g++) or set CXX",
        )
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        raise ExtensionBuildError(
            missing="Python headers",
            detail=f"Python.h not found in {sysconfig.get_paths()['include']}",
            fix="install the Python development headers (Debian/Ubuntu: apt install python3-dev)",
        )
    if plan.with_cuda and not any(
        (Path(d) / "cublas_v2.h").exists()
        for d in plan.include_dirs
        + plan.include_dirs_after
        + [os.path.join(os.environ.get("CUDA_HOME", ""), "include")]
    ):
        raise ExtensionBuildError(
            missing="cuBLAS headers",
            detail="cublas_v2.h is in neither the CUDA toolkit nor site-packages/nvidia/*/include",
            fix="pip install nvidia-cublas matching torch's CUDA, or build CPU-only with "
            "CUBLAS_GUARD_EXT_FORCE_CPU=1",
        )


def jit_build_directory(plan: _build.BuildPlan, prefix: str | None = None) -> str:
    """Where the JIT build of ``plan`` lives: ``TORCH_EXTENSIONS_DIR`` (or torch's default
    cache) / a name keyed by everything that makes a build incompatible (``_build.jit_name``)."""
    from torch.utils import cpp_extension

    return cpp_extension._get_build_directory(_build.jit_name(plan, prefix), False)


def _jit_build() -> NativeInfo:
    plan = _build.plan()
    if plan.with_cuda and os.environ.get("FORCE_CUDA") != "1":
        marker = _build.cuda_failed_before(plan, jit_build_directory(plan))
        if marker:
            print(
                f"{_build.PROGRESS_PREFIX} the CUDA build failed before ({marker}); using the "
                "CPU-only build (delete that file or edit a source to retry)",
                file=sys.stderr,
            )
            return _jit_build_plan(_build.plan(with_cuda=False))
    try:
        return _jit_build_plan(plan)
    except Exception as exc:
        # A CUDA build that failed to compile: say why, then build CPU-only (never leave
        # the user with no build at all); FORCE_CUDA=1 keeps it an error.
        note = _build.cuda_fallback_note(plan, exc)
        if note is None:
            raise
        print(f"{_build.PROGRESS_PREFIX} {note}", file=sys.stderr, flush=True)
        _build.record_cuda_failure(jit_build_directory(plan), note)
        return _jit_build_plan(_build.plan(with_cuda=False))


def _jit_build_plan(plan: _build.BuildPlan) -> NativeInfo:
    from torch.utils import cpp_extension

    from ..errors import ExtensionBuildError  # late: see the module docstring

    _preflight(plan)
    _build.apply_env(plan)
    flavour = "cuda" if plan.with_cuda else "cpu"
    name = _build.jit_name(plan)
    build_directory = jit_build_directory(plan)
    verbose = os.environ.get("CUBLAS_GUARD_EXT_VERBOSE_BUILD") == "1"
    title = f"no installed _C, JIT build ({flavour}, {plan.reason}), cached"
    try:
        with _build.torch_build_hooks(title=title):
            path = cpp_extension.load(
                name=name,
                sources=plan.sources,
                extra_cflags=plan.cxx_flags,
                extra_cuda_cflags=plan.nvcc_flags,
                # -l<library> before torch's own -l flags, which cpp_extension appends.
                extra_ldflags=[f"-L{d}" for d in plan.library_dirs]
                + [f"-l{lib}" for lib in plan.libraries]
                + plan.ldflags,
                extra_include_paths=plan.include_dirs,
                build_directory=build_directory,
                with_cuda=plan.with_cuda,
                is_python_module=False,
                verbose=verbose,
            )
    except Exception as exc:  # the compiler's output is in the message: keep its tail
        text = str(exc)
        raise ExtensionBuildError(
            missing="a successful compile",
            detail=f"JIT build ({flavour}, {plan.reason}) failed:\n" + "\n".join(text.splitlines()[-25:]),
            fix="rerun with CUBLAS_GUARD_EXT_VERBOSE_BUILD=1 for the full log; "
            "`python -m cublas_guard_ext doctor` checks the toolchain",
        ) from exc
    return NativeInfo("jit", str(path), _has_cuda_kernels(), f"{flavour} ({plan.reason})")


def load() -> NativeInfo:
    """Make ``torch.ops.cublas_guard`` available; idempotent and thread-safe."""
    global _info
    with _lock:
        if _info is not None:
            return _info
        info = None
        if os.environ.get("CUBLAS_GUARD_EXT_FORCE_JIT") != "1":
            info = _try_prebuilt()
        if info is None:
            info = _jit_build()
        if not _ops_registered():
            from ..errors import ExtensionBuildError  # late: see the module docstring

            raise ExtensionBuildError(
                missing="registered ops",
                detail=f"{info.path} loaded but torch.ops.cublas_guard.linear is not registered",
                fix="delete the build cache (TORCH_EXTENSIONS_DIR) and reinstall",
            )
        _info = info
        return info


def info() -> NativeInfo:
    """How the native library was loaded (loading it if needed)."""
    return load()
