"""Ahead-of-time build of the two native libraries (docs/building.md):

* ``cublas_guard_ext._core``: the stable core, built against LibTorch's stable C ABI and
  CPython's limited API (abi3): it loads beside every torch from its floor on, with any
  CPython >= 3.10 (cublas_guard_ext/_native/building/core_build.py);
* ``cublas_guard_ext._C``: the version-locked library for the torch it is built against (the
  fast eager entry, C++ autograd and autocast, watch): a CUDAExtension when CUDA is usable,
  else a CppExtension. Where it loads, it is used instead of the core.

Build with `pip install --no-build-isolation -e .` (or `make wheel`) so _C is compiled
against the torch it will run with (build isolation would fetch another torch). The source
lists, flags and the CUDA decision come from cublas_guard_ext/_native/building/, which the JIT loader
uses too.
"""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location(
    "_cublas_guard_build", ROOT / "cublas_guard_ext" / "_native" / "building" / "build.py"
)
_build = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _build  # dataclasses look their module up there
_spec.loader.exec_module(_build)

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

plan = _build.plan()
_core_build = _build._sibling("core_build")
_unity = _build._sibling("unity_build")
_build.apply_env(plan)
print(f"cublas_guard_ext: building {'CUDA' if plan.with_cuda else 'CPU-only'} extension ({plan.reason})")


def compiled_sources(build_plan, library):
    """The plan's sources as setuptools wants them (relative to setup.py), each unity group
    one generated file under build/unity/<library>/ (cublas_guard_ext/_native/building/unity_build.py)."""
    sources = _unity.unity_sources(build_plan.sources, ROOT / "build" / "unity" / library)
    return [str(Path(s).relative_to(ROOT)) for s in sources]


def make_extension(build_plan):
    sources = compiled_sources(build_plan, "_C")
    Extension = CUDAExtension if build_plan.with_cuda else CppExtension
    extension = Extension(
        name="cublas_guard_ext._C",
        sources=sources,
        include_dirs=build_plan.include_dirs,
        extra_compile_args={"cxx": build_plan.cxx_flags, "nvcc": build_plan.nvcc_flags},
        extra_link_args=build_plan.ldflags,
        libraries=list(build_plan.libraries),  # CppExtension appends torch's libraries after these
        library_dirs=build_plan.library_dirs,
    )
    if build_plan.cudart_library:
        # pip's toolkit has only libcudart.so.N: link it by file name instead of torch's -lcudart.
        extension.libraries = [
            build_plan.cudart_library if lib == "cudart" else lib for lib in extension.libraries
        ]
    return extension


def make_core_extension(build_plan):
    """The stable core: a limited-API (abi3) CppExtension, no libtorch_python."""
    sources = compiled_sources(build_plan, "_core")
    return CppExtension(
        name="cublas_guard_ext._core",
        sources=sources,
        include_dirs=build_plan.include_dirs,
        extra_compile_args={"cxx": build_plan.cxx_flags},
        extra_link_args=build_plan.ldflags,
        libraries=list(build_plan.libraries),
        library_dirs=build_plan.library_dirs,
        py_limited_api=True,
    )


def make_core_cuda_extension(build_plan):
    """The CUDA core (the CPU core's sources and the CUDA ones): a limited-API CUDAExtension."""
    sources = compiled_sources(build_plan, "_core_cuda")
    extension = CUDAExtension(
        name="cublas_guard_ext._core_cuda",
        sources=sources,
        include_dirs=build_plan.include_dirs,
        extra_compile_args={"cxx": build_plan.cxx_flags, "nvcc": build_plan.nvcc_flags},
        extra_link_args=build_plan.ldflags,
        # cuBLAS/cuBLASLt resolve through libtorch_cuda's own (pip's versioned files have no
        # unversioned link name), as in _C.
        libraries=list(build_plan.libraries),
        library_dirs=build_plan.library_dirs,
        py_limited_api=True,
    )
    if build_plan.cudart_library:
        extension.libraries = [
            build_plan.cudart_library if lib == "cudart" else lib for lib in extension.libraries
        ]
    return extension


def native_extensions(locked_plan):
    """_core, _core_cuda where the locked build is a CUDA one, and _C; CUBLAS_GUARD_EXT_BUILD=locked
    builds _C alone (CI's checks of the toolkit's discovery, which is _C's and _core_cuda's alike)."""
    only = os.environ.get("CUBLAS_GUARD_EXT_BUILD", "all")
    if only not in ("all", "locked"):
        raise SystemExit(f"cublas_guard_ext: CUBLAS_GUARD_EXT_BUILD={only!r}: use 'all' or 'locked'")
    extensions = [] if only == "locked" else [make_core_extension(_core_build.cpu_plan())]
    if locked_plan.with_cuda and only == "all":
        extensions.append(make_core_cuda_extension(_core_build.cuda_plan()))
    return extensions + [make_extension(locked_plan)]


class BuildWithSharedRuntime(BuildExtension.with_options(use_ninja=True)):
    """torch's BuildExtension, linking against the one shared libstdc++ torch uses.

    LDFLAGS or a Python's sysconfig may carry -static-libstdc++/-static-libgcc: the
    extension would then hold a private C++ runtime next to torch's (see build.shared_cxx_runtime).
    """

    def build_extensions(self) -> None:
        for attr in ("linker_so", "linker_so_cxx"):
            command = getattr(self.compiler, attr, None)
            if command:
                setattr(self.compiler, attr, _build.without_static_runtime(list(command)))
        try:
            super().build_extensions()
            record_locked_torch(self)
        except Exception as exc:
            # Never leave the user with no build where a CPU-only one is possible
            # (FORCE_CUDA=1 keeps a failed CUDA build an error).
            note = _build.cuda_fallback_note(plan, exc)
            if note is None:
                raise
            print(f"cublas_guard_ext: {note}", file=sys.stderr, flush=True)
            cpu_plan = _build.plan(with_cuda=False)
            print(f"cublas_guard_ext: building CPU-only extension ({cpu_plan.reason})", flush=True)
            self.extensions = native_extensions(cpu_plan)
            super().build_extensions()
            record_locked_torch(self)


# Progress lines (file, n of N, seconds) go to stderr; pip shows them with `pip install -v`.
class BuildPyWithSources(build_py):
    """The package plus csrc/ as cublas_guard_ext/_csrc: where the locked library is not
    prebuilt for the running torch, `python -m cublas_guard_ext build` compiles it from these."""

    def run(self) -> None:
        super().run()
        if not self.dry_run:
            target = Path(self.build_lib) / "cublas_guard_ext" / "_csrc"
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(ROOT / "csrc", target)


def record_locked_torch(build_ext_command) -> None:
    """_C.torch beside _C: the torch _C was built against (the loader uses _C only with it);
    _core_cuda.cuda beside _core_cuda: its CUDA major (it loads only beside a torch of it)."""
    import torch

    for ext in build_ext_command.extensions:
        if ext.name == "cublas_guard_ext._C":
            path = Path(build_ext_command.get_ext_fullpath(ext.name)).with_name("_C.torch")
            path.write_text(torch.__version__ + "\n")
        if ext.name == "cublas_guard_ext._core_cuda":  # the CUDA major it was built with
            path = Path(build_ext_command.get_ext_fullpath(ext.name)).with_name("_core_cuda.cuda")
            path.write_text(str(torch.version.cuda).split(".")[0] + "\n")


# The wheel's tag says abi3 (the core's); its _C serves only the CPython and torch it was
# built for, and the loader skips it everywhere else (cublas_guard_ext/_native/loading/loader.py).
with _build.torch_build_hooks():
    setup(
        ext_modules=native_extensions(plan),
        cmdclass={"build_ext": BuildWithSharedRuntime, "build_py": BuildPyWithSources},
        options={"bdist_wheel": {"py_limited_api": _core_build.ABI3_TAG}},
    )
