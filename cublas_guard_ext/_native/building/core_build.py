"""The stable core's build: the core's sources (``sources.CORE_*``) compiled against
LibTorch's stable C ABI alone, as ``cublas_guard_ext._core`` (CPU) and
``cublas_guard_ext._core_cuda`` (the CUDA kernels, linked to the CUDA libraries only).

``TORCH_TARGET_VERSION`` pins the oldest torch whose stable ABI the core may use (``FLOOR``,
docs/building.md says why 2.10): the headers of a newer torch refuse anything newer, and the
binary then loads beside every torch from the floor on. ``Py_LIMITED_API`` makes the module
abi3 (one binary for every CPython >= 3.10); the module itself is empty (csrc/core/core_module.cpp):
importing it runs the static op registrations. Like ``build``, loaded by path from setup.py.
"""

from __future__ import annotations

import dataclasses
import sys

if __package__:
    from . import build as _build
else:  # loaded by path through build._sibling (setup.py registered build.py under this name)
    _build = sys.modules["_cublas_guard_build"]
_sources = _build._sibling("sources")
_ninja = _build._sibling("ninja_build")

_compatibility = _build._sibling("loading.compatibility")
# The oldest torch the stable core runs on (loading/compatibility.py says why 2.10); the
# loader checks torch against it before the core is built or loaded.
FLOOR = _compatibility.FLOOR
torch_floor_error = _compatibility.torch_floor_error
TARGET_VERSION = "0x{:02x}{:02x}000000000000".format(*FLOOR)
# CPython 3.10's limited API: the module loads in every CPython from 3.10 on. setup.py's
# CppExtension(py_limited_api=True) defines Py_LIMITED_API as torch's own minimum, which is
# this one from torch 2.10 on; the JIT build (loader.py) defines it itself.
LIMITED_API = "0x030a0000"
ABI3_TAG = "cp310"
STABLE_DEFINES = [_ninja.STABLE_MARKER, f"-DTORCH_TARGET_VERSION={TARGET_VERSION}"]
CPU_MODULE_SOURCE = _sources.CORE_MODULE_SOURCE


def cpu_plan() -> _build.BuildPlan:
    """The CPU core: every core source in its stable flavour, no ATen, no OpenMP of ours
    (the scan runs on torch's intra-op pool through the stable parallel_for)."""
    base = _build.plan(with_cuda=False)
    cxx = [
        f
        for f in base.cxx_flags
        if f not in ("-fopenmp",) and not f.startswith("-DCUBLAS_GUARD_TORCH_VERSION")
    ]
    cxx += ["-fvisibility=hidden", *STABLE_DEFINES]
    sources = [str(_build.CSRC_DIR / s) for s in (*_sources.CORE_CPU_SOURCES, CPU_MODULE_SOURCE)]
    return dataclasses.replace(
        base,
        reason="the stable core (CPU)",
        sources=sources,
        cxx_flags=cxx,
        ldflags=[f for f in base.ldflags if f != "-fopenmp"],
    )


def cuda_plan() -> _build.BuildPlan:
    """The CUDA core, ``_core_cuda``: the CPU core's sources and the CUDA ones in one library
    (the CUDA kernels call the core's C++ directly), loaded *instead of* ``_core`` where torch
    has CUDA of the same major; linked against torch's CUDA libraries, so it is built in a venv
    with a CUDA torch (CI's CUDA stage), for the arch list build.plan chooses."""
    base = _build.plan(with_cuda=True)
    cuda_defines = ["-DUSE_CUDA", "-DCUBLAS_GUARD_WITH_CUDA"]
    nvcc = [f for f in base.nvcc_flags if not f.startswith("-DCUBLAS_GUARD_TORCH_VERSION")]
    nvcc += [*STABLE_DEFINES, *cuda_defines, "-Xcompiler", "-fvisibility=hidden"]
    sources = [
        str(_build.CSRC_DIR / s)
        for s in (*_sources.CORE_CPU_SOURCES, *_sources.CORE_CUDA_SOURCES)  # core_cuda_module.cpp among them
    ]
    return dataclasses.replace(
        base,
        reason=f"the stable core (CUDA; {base.reason})",
        sources=sources,
        # The CUDA plan's C++ flags (its private cuBLAS headers: -idirafter), made the core's.
        cxx_flags=[
            f
            for f in base.cxx_flags
            if f not in ("-fopenmp", "-DCUBLAS_GUARD_WITH_CUDA")
            and not f.startswith("-DCUBLAS_GUARD_TORCH_VERSION")
        ]
        + ["-fvisibility=hidden", *STABLE_DEFINES, *cuda_defines],
        nvcc_flags=nvcc,
        ldflags=[f for f in base.ldflags if f != "-fopenmp"],
    )
