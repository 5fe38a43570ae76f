"""Loading the native ops: the version-locked ``_C`` where it was built for this torch, else
the stable core ``_core`` (one prebuilt binary for every torch from its floor on), else a
JIT build. ``CUBLAS_GUARD_EXT_NATIVE`` = ``auto`` (default) | ``locked`` | ``core`` forces one.

The version-locked library (the fast eager entry, C++ autograd and autocast, watch) is
used wherever it loads: a prebuilt ``_C`` (an editable install, or the wheel on the torch and
CPython it was built with), or a JIT build already in the cache for this torch (made by
``python -m cublas_guard_ext build``). Elsewhere the stable core runs the same op sources
(csrc/core/tensor_api.h) and ``core_twins/stable_core.py`` registers in Python what the stable ABI cannot
(autograd, autocast, fake kernels); watch then says how to build the locked library.

The JIT build compiles the same sources with the same flags as ``setup.py``
(see ``building/build.py``) through ``torch.utils.cpp_extension.load`` and ninja, into
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
import importlib.util
import os
import shutil
import sys
import sysconfig
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import compatibility as _compatibility

if TYPE_CHECKING:
    from ..building.build import BuildPlan

_lock = threading.Lock()


@dataclass(frozen=True)
class NativeInfo:
    """How the native library was obtained."""

    kind: str  # "prebuilt" | "jit"
    path: str
    has_cuda_kernels: bool
    detail: str
    # "locked": the ATen library for this torch (everything); "core": the stable core alone.
    library: str = "locked"


NATIVE_CHOICES = ("auto", "locked", "core")


_info: NativeInfo | None = None


def _ops_registered() -> bool:
    return hasattr(torch.ops, "cublas_guard") and hasattr(torch.ops.cublas_guard, "linear")


def _has_cuda_kernels() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("cublas_guard::linear", "CUDA")


def _built_for_this_torch(module_path: Path) -> bool:
    """Whether the prebuilt _C next to ``module_path`` was built for the running torch (the
    wheel records it in _C.torch, written by setup.py); a tree without the record (an editable
    install) is taken to be."""
    record = module_path.with_name("_C.torch")
    return not record.exists() or record.read_text().strip() == torch.__version__


def _try_prebuilt(warn: bool = True) -> NativeInfo | None:
    spec = importlib.util.find_spec("cublas_guard_ext._C")
    if spec is None or spec.origin is None:
        return None
    if not _built_for_this_torch(Path(spec.origin)):
        return None  # the wheel's _C is another torch's: the core serves this one
    try:
        module = importlib.import_module("cublas_guard_ext._C")
    except ImportError as exc:  # present but unloadable: usually built against another torch
        if warn:
            warnings.warn(
                f"cublas_guard_ext: the installed _C failed to load ({exc}); it was probably built "
                f"against another torch than {torch.__version__}. Using the stable core (or a "
                "JIT build); reinstall with `pip install --no-build-isolation -e .` to fix it for good.",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    return NativeInfo("prebuilt", str(module.__file__), _has_cuda_kernels(), "installed _C")


def _try_core() -> NativeInfo | None:
    """The stable core, if installed and this torch is at or above its floor: ``_core_cuda``
    (the CPU core and the CUDA kernels in one library) where torch has CUDA of the major it
    was built for, else ``_core`` (never loading libcudart beside a CPU-only torch)."""
    if importlib.util.find_spec("cublas_guard_ext._core") is None:
        return None
    reason = _compatibility.torch_floor_error(torch.__version__)
    if reason is not None:
        from ...errors import ExtensionBuildError  # late: see the module docstring

        floor = "{}.{}".format(*_compatibility.FLOOR)
        raise ExtensionBuildError(missing=f"torch >= {floor}", detail=reason, fix=reason.rsplit(". ", 1)[-1])
    name, note = _core_module_for_this_torch()
    module = importlib.import_module(f"cublas_guard_ext.{name}")
    detail = "stable core" + (f" ({note})" if note else "")
    return NativeInfo("prebuilt", str(module.__file__), _has_cuda_kernels(), detail, library="core")


def _core_module_for_this_torch() -> tuple[str, str | None]:
    """``_core_cuda`` or ``_core``, and a note when torch has CUDA but gets no CUDA kernels."""
    if not torch.version.cuda:
        return "_core", None
    if importlib.util.find_spec("cublas_guard_ext._core_cuda") is None:
        return "_core", "no CUDA kernels in this install: a CPU-only wheel"
    built_for, major = _core_cuda_major(), torch.version.cuda.split(".")[0]
    if built_for is not None and built_for != major:
        return "_core", (
            f"CUDA kernels left out: this wheel's are for CUDA {built_for}, this torch uses CUDA "
            f"{torch.version.cuda}; install the wheel built for CUDA {major}"
        )
    return "_core_cuda", None


def _core_cuda_major() -> str | None:
    """The CUDA major the wheel's CUDA core was built for (recorded by setup.py), if known."""
    spec = importlib.util.find_spec("cublas_guard_ext._core_cuda")
    record = Path(spec.origin).with_name("_core_cuda.cuda") if spec and spec.origin else None
    return record.read_text().strip() if record is not None and record.exists() else None


def _preflight(plan: BuildPlan) -> None:
    """Say exactly what is missing before a compiler says it less clearly."""
    from ...errors import ExtensionBuildError  # late: see the module docstring

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


def jit_build_directory(plan: BuildPlan, prefix: str | None = None) -> str:
    """Where the JIT build of ``plan`` lives: ``TORCH_EXTENSIONS_DIR`` (or torch's default
    cache) / a name keyed by everything that makes a build incompatible (``_build.jit_name``)."""
    from torch.utils import cpp_extension

    from ..building import build as _build  # late: building is imported only to build

    return cpp_extension._get_build_directory(_build.jit_name(plan, prefix), False)


def _jit_build() -> NativeInfo:
    from ..building import build as _build  # late: building is imported only to build

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


def _jit_build_plan(plan: BuildPlan, label: str = "no installed _C") -> NativeInfo:
    from torch.utils import cpp_extension

    from ...errors import ExtensionBuildError  # late: see the module docstring
    from ..building import build as _build  # late: building is imported only to build
    from ..building import unity_build as _unity  # late: building is imported only to build

    _preflight(plan)
    _build.apply_env(plan)
    flavour = "cuda" if plan.with_cuda else "cpu"
    name = _build.jit_name(plan)
    build_directory = jit_build_directory(plan)
    verbose = os.environ.get("CUBLAS_GUARD_EXT_VERBOSE_BUILD") == "1"
    title = f"{label}, JIT build ({flavour}, {plan.reason}), cached"
    try:
        with _build.torch_build_hooks(title=title):
            path = cpp_extension.load(
                name=name,
                sources=_unity.unity_sources(plan.sources, Path(build_directory) / "unity"),
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


def _jit_build_core() -> NativeInfo:
    """The stable core compiled here (a source checkout's development and test path; users
    get it prebuilt): the same flags as setup.py's, plus the limited API torch's setup adds."""
    from ..building import core_build as _core_build  # late: building is imported only to build

    plan = _core_build.cpu_plan()
    plan.cxx_flags.append(f"-DPy_LIMITED_API={_core_build.LIMITED_API}")
    info = _jit_build_plan(plan, label="stable core")
    return NativeInfo("jit", info.path, _has_cuda_kernels(), "stable core (JIT)", library="core")


def _cached_locked_build() -> NativeInfo | None:
    """A JIT build of the locked library for this torch that is already in the cache (made
    by `python -m cublas_guard_ext build`), loaded without compiling, or None. Where the cache
    has none by name (the usual case: the wheel's core serves), nothing is probed or imported:
    the full key, which asks the compiler and the toolkit, is computed only to load a build."""
    if not _compatibility.locked_jit_build_may_exist():
        return None  # before the import below: a torch the wheel's _C is not for lands here
    from ..building import build as _build  # late: building is imported only to build a key

    plan = _build.plan()
    path = Path(jit_build_directory(plan)) / f"{_build.jit_name(plan)}.so"
    if not path.exists() or not _sources_present(plan):
        return None
    return _jit_build_plan(plan)  # up to date: ninja has nothing to do, so this only loads


def _sources_present(plan: BuildPlan) -> bool:
    return all(Path(s).exists() for s in plan.sources)


def native_choice() -> str:
    """CUBLAS_GUARD_EXT_NATIVE's value, checked."""
    choice = os.environ.get("CUBLAS_GUARD_EXT_NATIVE", "auto") or "auto"
    if choice not in NATIVE_CHOICES:
        from ...errors import ExtensionBuildError  # late: see the module docstring

        raise ExtensionBuildError(
            missing="a valid CUBLAS_GUARD_EXT_NATIVE",
            detail=f"CUBLAS_GUARD_EXT_NATIVE={choice!r}",
            fix="set it to "
            + ", ".join(NATIVE_CHOICES)
            + " (auto: the locked library where it loads, else the core)",
        )
    return choice


def load() -> NativeInfo:
    """Make ``torch.ops.cublas_guard`` available; idempotent and thread-safe."""
    global _info
    with _lock:
        if _info is not None:
            return _info
        choice = native_choice()
        prebuilt_allowed = os.environ.get("CUBLAS_GUARD_EXT_FORCE_JIT") != "1"
        info = None
        if prebuilt_allowed and choice != "core":
            info = _try_prebuilt(warn=choice == "locked")
        if info is None and prebuilt_allowed and choice == "auto":
            info = _cached_locked_build()
        if info is None and prebuilt_allowed and choice != "locked":
            info = _try_core()
        if info is None:
            info = _jit_build_core() if choice == "core" else _jit_build()
        if not _ops_registered():
            from ...errors import ExtensionBuildError  # late: see the module docstring

            raise ExtensionBuildError(
                missing="registered ops",
                detail=f"{info.path} loaded but torch.ops.cublas_guard.linear is not registered",
                fix="delete the build cache (TORCH_EXTENSIONS_DIR) and reinstall",
            )
        if info.library == "core":
            from ..core_twins import stable_core, stable_core_grouped

            stable_core.register()
            stable_core_grouped.register(stable_core.library())
        _info = info
        return info


def build_locked() -> NativeInfo:
    """Compile the version-locked library for this torch into the JIT cache (the `build`
    command); the next process loads it (CUBLAS_GUARD_EXT_NATIVE=auto) instead of the core."""
    return _jit_build()


def info() -> NativeInfo:
    """How the native library was loaded (loading it if needed)."""
    return load()
