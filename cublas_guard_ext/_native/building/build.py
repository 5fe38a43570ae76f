"""Build configuration shared by ``setup.py`` and the JIT loader.

One source of truth for the source list, the compiler flags and the decision
"build the CUDA kernels or not". ``setup.py`` loads this file by path, so it
must not import the package (which would try to load the extension).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path


def _sibling(name: str):
    """A module of this folder, or with a dot one of _native's others ("loading.compatibility"),
    also when setup.py loaded this file by path (no package)."""
    if __package__:
        parent = __package__.rpartition(".")[0] if "." in name else __package__
        return importlib.import_module(f"{parent}.{name}")
    qualified = f"_cublas_guard_{name.replace('.', '_')}"
    if qualified not in sys.modules:
        parts = ["..", *name.split(".")] if "." in name else [name]
        path = Path(__file__).parent.joinpath(*parts[:-1], f"{parts[-1]}.py")
        spec = importlib.util.spec_from_file_location(qualified, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    return sys.modules[qualified]


_toolkit = _sibling("toolkit")
_compatibility = _sibling("loading.compatibility")
# Names only, no compiler asked: the loader's lookup of a cached build (loading/compatibility.py).
_jit_name_prefix = _compatibility.jit_name_prefix
locked_jit_build_may_exist = _compatibility.locked_jit_build_may_exist
# Used by setup.py, the loader and the tests under these names (defined in toolkit.py).
decide_cuda, cuda_fallback_note, record_cuda_failure, link_cudart_by_name = (
    _toolkit.decide_cuda,
    _toolkit.cuda_fallback_note,
    _toolkit.record_cuda_failure,
    _toolkit.link_cudart_by_name,
)

PACKAGE_DIR = Path(__file__).resolve().parents[2]  # cublas_guard_ext/ (this file is in _native/building/)
# A source checkout's csrc/, else the copy an installed wheel carries (setup.py's build_py).
CSRC_DIR = PACKAGE_DIR.parent / "csrc"
if not CSRC_DIR.is_dir() and (PACKAGE_DIR / "_csrc").is_dir():
    CSRC_DIR = PACKAGE_DIR / "_csrc"

_sources = _sibling("sources")
_ninja = _sibling("ninja_build")
# Used by setup.py, the loader, .ci/ and the tests under these names (defined in ninja_build.py).
PCH_HEADER, PCH_INCLUDES, NO_PCH_SOURCES, SLOW_SOURCES = (
    _ninja.PCH_HEADER,
    _ninja.PCH_INCLUDES,
    _ninja.NO_PCH_SOURCES,
    _ninja.SLOW_SOURCES,
)
PROGRESS_PREFIX, HEARTBEAT_S = _ninja.PROGRESS_PREFIX, _ninja.HEARTBEAT_S
pch_enabled, rewrite_ninja_file, run_ninja, torch_build_hooks = (
    _ninja.pch_enabled,
    _ninja.rewrite_ninja_file,
    _ninja.run_ninja,
    _ninja.torch_build_hooks,
)
# The sources, relative to CSRC_DIR (defined in sources.py).
CPU_SOURCES, CUDA_SOURCES = _sources.CPU_SOURCES, _sources.CUDA_SOURCES


@dataclass
class BuildPlan:
    """What to compile and how; ``with_cuda`` explains itself in ``reason``."""

    with_cuda: bool
    reason: str
    sources: list[str]
    cxx_flags: list[str]
    nvcc_flags: list[str]
    ldflags: list[str]
    include_dirs: list[str] = field(default_factory=list)
    # Linked before torch's own libraries, from library_dirs (see shared_cxx_runtime).
    libraries: list[str] = field(default_factory=list)
    library_dirs: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Searched after every other include dir, the toolkit's and torch's too (GCC's
    # -idirafter; already in cxx_flags/nvcc_flags): the wheel headers the toolkit lacks.
    include_dirs_after: list[str] = field(default_factory=list)
    # Said before compiling (see announce_notes): e.g. nvcc's CUDA differs from torch's.
    notes: list[str] = field(default_factory=list)
    # The CUDA toolkit the build uses (a resolved fact: the JIT key names it) and its nvcc's
    # release; None for a CPU build.
    cuda_home: str | None = None
    nvcc_version: str | None = None
    # The CUDA runtime to link instead of torch's ``-lcudart`` (``:libcudart.so.13``) when
    # the toolkit has only the versioned file, as pip's has; None: torch's flag links.
    cudart_library: str | None = None


def _torch_version_macro() -> str:
    import torch

    # A bare token the C++ side stringifies; keep it to [A-Za-z0-9_.+].
    return re.sub(r"[^A-Za-z0-9_.+]", "_", torch.__version__)


_cxx_flags = _sibling("cxx_flags")
# Used by setup.py, .ci/ and the tests under these names (defined in cxx_flags.py).
shared_cxx_runtime, without_static_runtime = _cxx_flags.shared_cxx_runtime, _cxx_flags.without_static_runtime
sanitizer_flags = _cxx_flags.sanitizer_flags


def plan(with_cuda: bool | None = None) -> BuildPlan:
    """The build plan for this machine (``with_cuda`` overrides the decision)."""
    import torch

    decided, reason = _toolkit.decide_cuda()
    if with_cuda is None:
        with_cuda = decided
    elif with_cuda != decided:
        reason = f"requested with_cuda={with_cuda} (auto: {reason})"
    version = _torch_version_macro()
    cxx = [
        # -O2, not -O3: the hot loop (the scan) is written with explicit vector types and
        # compiles to the same code; -O3 only made every TU slower to build. -g0: Python's
        # own CFLAGS (pyenv's carry -g) would add debug info for all of ATen (a 10 MB .so).
        "-O2",
        "-g0",
        "-fopenmp",  # at::parallel_for is an OpenMP pragma in the headers: without it, one thread
        "-Wall",
        f"-DCUBLAS_GUARD_TORCH_VERSION={version}",
    ]
    # nvcc's -O is the host compiler's (device code is optimized by ptxas either way).
    nvcc = ["-O2", "-lineinfo", f"-DCUBLAS_GUARD_TORCH_VERSION={version}"]
    ldflags = ["-fopenmp"]
    sanitize = sanitizer_flags()
    if sanitize:
        cxx = [f for f in cxx if f != "-O2"] + sanitize
        ldflags += [f for f in sanitize if f.startswith("-fsanitize")]
    sources = [str(CSRC_DIR / s) for s in CPU_SOURCES]
    include_dirs = [str(CSRC_DIR)]
    env: dict[str, str] = {}
    include_after: list[str] = []
    notes: list[str] = []
    library_dirs: list[str] = []
    cuda_home = nvcc_release = cudart_library = None
    if with_cuda:
        sources += [str(CSRC_DIR / s) for s in CUDA_SOURCES]
        cuda_home = _toolkit.find_cuda_home()
        if cuda_home:
            env["CUDA_HOME"] = cuda_home
            nvcc_release = _toolkit.nvcc_version(cuda_home)
            note = _toolkit.cuda_version_note(nvcc_release, torch.version.cuda, cuda_home)
            if note:
                notes.append(note)
            cudart_library = _toolkit.cudart_link_name(cuda_home)
            if cudart_library:
                # pip's toolkit: link the versioned runtime by file name, from its lib folder.
                library_dirs += [
                    str(Path(cuda_home) / lib)
                    for lib in ("lib64", "lib")
                    if (Path(cuda_home) / lib / cudart_library[1:]).exists()
                ][:1]
            # Only the wheel headers the toolkit lacks (cuBLAS & co.), searched after the
            # toolkit's: the wheel's own cuda_runtime.h must never shadow the toolkit's.
            private = _toolkit.cuda_wheel_include_dir(
                _toolkit.cublas_include_dirs(), str(Path(cuda_home) / "include")
            )
            if private:
                include_after.append(private)
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            env["TORCH_CUDA_ARCH_LIST"] = _toolkit.default_arch_list()
        cxx.append("-DCUBLAS_GUARD_WITH_CUDA")
        for directory in include_after:
            cxx.append(f"-idirafter{directory}")
            nvcc += ["-Xcompiler", f"-idirafter{directory}"]  # nvcc has no -idirafter of its own
    cxx_runtime_libraries, cxx_runtime_dirs = shared_cxx_runtime()
    return BuildPlan(
        with_cuda=with_cuda,
        reason=reason,
        sources=sources,
        cxx_flags=cxx,
        nvcc_flags=nvcc,
        ldflags=ldflags,
        include_dirs=include_dirs,
        libraries=cxx_runtime_libraries,
        library_dirs=cxx_runtime_dirs + library_dirs,
        env=env,
        include_dirs_after=include_after,
        notes=notes,
        cuda_home=cuda_home,
        nvcc_version=nvcc_release,
        cudart_library=cudart_library,
    )


def effective_env(build: BuildPlan) -> dict[str, str]:
    """The values torch's builder will see once apply_env ran: the user's own
    non-empty setting wins, the plan's default fills in the rest."""
    return {key: os.environ.get(key) or value for key, value in build.env.items()}


def apply_env(build: BuildPlan) -> None:
    """Export the plan's environment (CUDA_HOME, arch list) for torch's builder.

    The plan's notes are said by the build hooks before ninja compiles anything (not
    when the build is up to date, as on every warm JIT import).
    """
    from torch.utils import cpp_extension

    for key, value in effective_env(build).items():
        os.environ[key] = value
    if "CUDA_HOME" in build.env:
        # cpp_extension read CUDA_HOME at import time; correct its guess too.
        cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]
    _ninja.pending_notes[:] = build.notes
    _ninja.pending_cudart[:] = [build.cudart_library] if build.cudart_library else []
    _ninja.link_cudart_by_name[:] = [_toolkit.link_cudart_by_name]
    if build.notes and not hasattr(cpp_extension, "_run_ninja_build"):  # no hooks: say it now
        for note in build.notes:
            print(f"{PROGRESS_PREFIX} NOTE: {note}", file=sys.stderr, flush=True)


def cuda_failed_before(build: BuildPlan, build_directory: str) -> str | None:
    """The failure marker's path if ``build`` failed in ``build_directory`` since the last
    edit of a source or header (toolkit.record_cuda_failure), else None."""
    return _toolkit.cuda_failed_before(
        build.sources + [str(p) for p in CSRC_DIR.rglob("*.h")], build_directory
    )


# ---------------------------------------------------------------------------
# JIT cache key: one build directory per incompatible environment
# ---------------------------------------------------------------------------
def jit_cache_key(build: BuildPlan, prefix: str | None = None) -> dict[str, object]:
    """Everything that makes a JIT build unusable elsewhere, from resolved facts only: the
    prefix (two venvs never share a directory), torch, the flags and include dirs (another
    checkout is another build), the toolkit's real path and nvcc's release. Nothing depends
    on how the process started: the private header folder lives under TORCH_EXTENSIONS_DIR,
    which processes may set differently, so it enters by its (digest) name, not its place.
    Source edits are not in it: ninja rebuilds the changed files in place."""
    import torch

    def portable(values: list[str]) -> list[str]:
        out = []
        for value in values:
            for directory in build.include_dirs_after:
                value = value.replace(directory, os.path.basename(directory))
            out.append(value)
        return out

    return {
        "prefix": os.path.realpath(prefix if prefix is not None else sys.prefix),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "cxx11_abi": bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)),
        "python": sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag,
        "compiler": os.environ.get("CXX", "c++"),
        "with_cuda": build.with_cuda,
        "cuda_home": os.path.realpath(build.cuda_home) if build.with_cuda and build.cuda_home else None,
        # The nvcc major too: a build by nvcc 13 must not be loaded under a CUDA 12 runtime.
        "nvcc": build.nvcc_version if build.with_cuda else None,
        "cudart": build.cudart_library if build.with_cuda else None,
        # The list torch will build for: the same before and after apply_env ran.
        "arch_list": effective_env(build).get("TORCH_CUDA_ARCH_LIST", os.environ.get("TORCH_CUDA_ARCH_LIST"))
        if build.with_cuda
        else None,
        "cxx_flags": portable(build.cxx_flags),
        "nvcc_flags": portable(build.nvcc_flags) if build.with_cuda else [],
        "ldflags": build.ldflags,
        "libraries": build.libraries,
        "library_dirs": build.library_dirs,
        "include_dirs": build.include_dirs,
        "include_dirs_after": [os.path.basename(d) for d in build.include_dirs_after],
        "pch": pch_enabled(),
    }


def jit_name(build: BuildPlan, prefix: str | None = None) -> str:
    """The JIT build's name (its cache directory and .so): readable part + key digest."""
    key = jit_cache_key(build, prefix)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    flavour = "cuda" if build.with_cuda else "cpu"
    if _ninja.STABLE_MARKER in build.cxx_flags:
        flavour = "core_" + flavour
    return f"{_jit_name_prefix(flavour)}{digest}"
