"""Build configuration shared by ``setup.py`` and the JIT loader.

One source of truth for the source list, the compiler flags and the decision
"build the CUDA kernels or not". ``setup.py`` loads this file by path, so it
must not import the package (which would try to load the extension).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CSRC_DIR = PACKAGE_DIR.parent / "csrc"

CPU_SOURCES = (
    "bindings.cpp",
    "errors.cpp",
    "checks.cpp",
    "linear_common.cpp",
    "scan_cpu.cpp",
    "linear_cpu.cpp",
    "autograd.cpp",
    "python_errors.cpp",
    "watch.cpp",
)
CUDA_SOURCES = ("cuda/scan.cu", "cuda/linear.cu")


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
    env: dict[str, str] = field(default_factory=dict)


def _torch_version_macro() -> str:
    import torch

    # A bare token the C++ side stringifies; keep it to [A-Za-z0-9_.+].
    return re.sub(r"[^A-Za-z0-9_.+]", "_", torch.__version__)


def find_cuda_home() -> str | None:
    """A CUDA toolkit root with bin/nvcc and include/cuda_runtime.h, if any.

    torch's own guess can be a wrapper's prefix (``/usr/local`` when
    ``/usr/local/bin/nvcc`` is a script), so every candidate is verified.
    """
    from torch.utils import cpp_extension

    candidates = [
        os.environ.get("CUDA_HOME"),
        os.environ.get("CUDA_PATH"),
        cpp_extension.CUDA_HOME,
        "/usr/local/cuda",
    ]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    for root in candidates:
        if root and (Path(root) / "bin" / "nvcc").exists() and (
            Path(root) / "include" / "cuda_runtime.h"
        ).exists():
            return root
    return None


def cublas_include_dirs() -> list[str]:
    """Where pip's nvidia-cublas wheel put cublas_v2.h (torch does not add it)."""
    found: list[str] = []
    for base in sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]:
        for header in glob.glob(os.path.join(base, "nvidia", "*", "include", "cublas_v2.h")):
            found.append(os.path.dirname(header))
        for header in glob.glob(os.path.join(base, "nvidia", "*", "*", "include", "cublas_v2.h")):
            found.append(os.path.dirname(header))
    return sorted(set(found))


def decide_cuda() -> tuple[bool, str]:
    """Whether to build the CUDA kernels, and why (shown by the doctor)."""
    import torch

    if os.environ.get("CUBLAS_GUARD_EXT_FORCE_CPU") == "1":
        return False, "CUBLAS_GUARD_EXT_FORCE_CPU=1"
    force = os.environ.get("FORCE_CUDA") == "1"
    if torch.version.cuda is None:
        if force:
            raise RuntimeError(
                "FORCE_CUDA=1 but this torch is a CPU-only build "
                f"({torch.__version__}); install a CUDA build of torch first"
            )
        return False, f"torch {torch.__version__} is a CPU-only build"
    cuda_home = find_cuda_home()
    if cuda_home is None:
        if force:
            raise RuntimeError(
                "FORCE_CUDA=1 but no CUDA toolkit (bin/nvcc + include/cuda_runtime.h) was "
                "found; set CUDA_HOME to the toolkit root"
            )
        return False, "no CUDA toolkit found (set CUDA_HOME to build the CUDA kernels)"
    why = "FORCE_CUDA=1" if force else f"torch {torch.__version__} and a CUDA toolkit at {cuda_home}"
    return True, why


def default_arch_list() -> str:
    """The GPU archs to build for when no GPU is visible: torch's own list.

    Building for what torch itself supports means the extension never lacks
    an arch that torch has, the failure the doctor checks for.
    """
    import torch

    archs = []
    for arch in torch.cuda.get_arch_list():
        match = re.fullmatch(r"sm_(\d+)(\d)", arch)
        if match:
            archs.append(f"{match.group(1)}.{match.group(2)}")
    if not archs:
        return "8.0;9.0+PTX"
    archs[-1] += "+PTX"  # PTX of the newest arch lets future GPUs JIT-compile it
    return ";".join(archs)


def plan(with_cuda: bool | None = None) -> BuildPlan:
    """The build plan for this machine (``with_cuda`` overrides the decision)."""
    import torch

    decided, reason = decide_cuda()
    if with_cuda is None:
        with_cuda = decided
    elif with_cuda != decided:
        reason = f"requested with_cuda={with_cuda} (auto: {reason})"
    version = _torch_version_macro()
    cxx = [
        "-O3",
        "-fopenmp",  # at::parallel_for is an OpenMP pragma in the headers: without it, one thread
        "-Wall",
        f"-DCUBLAS_GUARD_TORCH_VERSION={version}",
    ]
    nvcc = ["-O3", "-lineinfo", f"-DCUBLAS_GUARD_TORCH_VERSION={version}"]
    sources = [str(CSRC_DIR / s) for s in CPU_SOURCES]
    include_dirs = [str(CSRC_DIR)]
    env: dict[str, str] = {}
    if with_cuda:
        sources += [str(CSRC_DIR / s) for s in CUDA_SOURCES]
        include_dirs += cublas_include_dirs()
        cuda_home = find_cuda_home()
        if cuda_home:
            env["CUDA_HOME"] = cuda_home
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            env["TORCH_CUDA_ARCH_LIST"] = default_arch_list()
        cxx.append("-DCUBLAS_GUARD_WITH_CUDA")
    return BuildPlan(
        with_cuda=with_cuda,
        reason=reason,
        sources=sources,
        cxx_flags=cxx,
        nvcc_flags=nvcc,
        ldflags=["-fopenmp"],
        include_dirs=include_dirs,
        env=env,
    )


def apply_env(build: BuildPlan) -> None:
    """Export the plan's environment (CUDA_HOME, arch list) for torch's builder."""
    for key, value in build.env.items():
        os.environ.setdefault(key, value)
    if "CUDA_HOME" in build.env:
        from torch.utils import cpp_extension

        # cpp_extension read CUDA_HOME at import time; correct its guess too.
        cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]
