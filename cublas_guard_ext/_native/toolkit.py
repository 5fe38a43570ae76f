"""The CUDA toolkit and torch's CUDA wheels: what a CUDA build of the extension needs.

Finding the toolkit (nvcc), comparing its CUDA with torch's and saying so, the cuBLAS
headers (from the toolkit, else the few that torch's nvidia wheels add, never those
wheels' runtime headers), the arch list with no GPU visible, and what happens when a
CUDA build cannot work or fails: a CPU-only build, with the reason said. ``build.py``
uses it (and re-exports its names); like build.py it must not import the package,
since ``setup.py`` loads both by path.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path


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
        if (
            root
            and (Path(root) / "bin" / "nvcc").exists()
            and (Path(root) / "include" / "cuda_runtime.h").exists()
        ):
            return root
    return None


def cublas_include_dirs() -> list[str]:
    """Where pip's nvidia-cublas wheel put cublas_v2.h (torch does not add it).

    These folders (``site-packages/nvidia/cu13/include``) hold the runtime headers of the
    CUDA that torch was built with as well; never put them on the include path whole
    (see cuda_wheel_include_dir).
    """
    found: list[str] = []
    for base in sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]:
        for header in glob.glob(os.path.join(base, "nvidia", "*", "include", "cublas_v2.h")):
            found.append(os.path.dirname(header))
        for header in glob.glob(os.path.join(base, "nvidia", "*", "*", "include", "cublas_v2.h")):
            found.append(os.path.dirname(header))
    return sorted(set(found))


@functools.lru_cache(maxsize=16)
def nvcc_version(cuda_home: str) -> str | None:
    """The CUDA release of ``cuda_home``'s nvcc ("13.0"), or None if it cannot be read
    (asked once per process: the decision and the plan both need it)."""
    try:
        out = subprocess.run(
            [str(Path(cuda_home) / "bin" / "nvcc"), "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out)
    return f"{match.group(1)}.{match.group(2)}" if match else None


def cuda_version_note(nvcc: str | None, torch_cuda: str | None, cuda_home: str) -> str | None:
    """What to tell a user whose nvcc and torch's CUDA differ (None when they agree)."""
    if not nvcc or not torch_cuda or nvcc == ".".join(torch_cuda.split(".")[:2]):
        return None
    same_major = nvcc.split(".")[0] == torch_cuda.split(".")[0]
    what = (
        "the extension is compiled with the toolkit's own CUDA headers (only the cuBLAS "
        "headers the toolkit lacks come from torch's nvidia wheels) and runs with torch's "
        "CUDA libraries"
        if same_major
        else "CUDA code compiled by this nvcc cannot run with this torch: building CPU-only"
    )
    return (
        f"nvcc at {cuda_home} is CUDA {nvcc}, torch {_torch_version()} was built with CUDA "
        f"{torch_cuda}: {what}. Fix: a CUDA {torch_cuda} toolkit (CUDA_HOME=<its root>), "
        f"or a torch built for CUDA {nvcc}; CUBLAS_GUARD_EXT_FORCE_CPU=1 builds CPU-only"
    )


def _torch_version() -> str:
    import torch

    return torch.__version__


def _header_names(include_dir: str) -> list[str]:
    try:
        return sorted(os.listdir(include_dir))
    except OSError:
        return []


def cuda_wheel_include_dir(
    wheel_dirs: list[str], toolkit_include: str, root: str | None = None
) -> str | None:
    """A private include dir with the wheel headers the toolkit lacks, or None if none.

    torch's CUDA wheels put cuBLAS (and cuSPARSE, cuSOLVER, which ATen's CUDA headers
    also include) into ``site-packages/nvidia/cuXX/include`` next to the runtime headers
    of torch's CUDA. Putting that folder on the include path lets its cuda_runtime.h
    shadow the toolkit's, and an nvcc older than torch's CUDA then stops at
    ``#error "CUDA compiler and CUDA toolkit headers are incompatible"``. This folder
    holds symlinks to exactly those top-level entries of the wheel folders that the
    toolkit's include/ lacks, so the toolkit's own headers always win.

    It lives under torch's extension build root (TORCH_EXTENSIONS_DIR, else torch's
    cache; a temp dir if that is not writable), named by a digest of what it links:
    every setup.py and JIT build with the same wheels and toolkit shares one.
    """
    toolkit = set(_header_names(toolkit_include))
    links: dict[str, str] = {}
    for wheel_dir in wheel_dirs:
        for name in _header_names(wheel_dir):
            if name not in toolkit and name not in links:
                links[name] = os.path.join(os.path.realpath(wheel_dir), name)
    if not links:
        return None
    digest = hashlib.sha256(json.dumps(sorted(links.items())).encode()).hexdigest()[:12]
    roots = [root] if root is not None else [_build_root(), tempfile.gettempdir()]
    error: OSError | None = None
    for base in roots:
        target = os.path.join(base, f"cublas_guard_ext_cuda_include_{digest}")
        try:
            _make_link_dir(target, links)
            return target
        except OSError as exc:
            error = exc
    raise OSError(f"could not create the cuBLAS include dir under {roots}: {error}")


def _build_root() -> str:
    from torch.utils import cpp_extension

    return os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()


def _make_link_dir(target: str, links: dict[str, str]) -> None:
    """``target`` holding exactly ``links`` (name -> path) as symlinks; safe under races."""

    def complete() -> bool:
        return all(
            os.path.islink(os.path.join(target, n)) and os.readlink(os.path.join(target, n)) == p
            for n, p in links.items()
        )

    if os.path.isdir(target) and complete():
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=os.path.basename(target) + ".", dir=os.path.dirname(target))
    try:
        for name, path in links.items():
            os.symlink(path, os.path.join(staging, name))
        try:
            os.rename(staging, target)  # atomic; fails if another process made it first
            staging = ""
        except OSError:
            if not (os.path.isdir(target) and complete()):
                shutil.rmtree(target, ignore_errors=True)
                os.rename(staging, target)
                staging = ""
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)


def decide_cuda() -> tuple[bool, str]:
    """Whether to build the CUDA kernels, and why (shown by the doctor).

    A CUDA build that cannot work (nvcc's CUDA major differs from torch's, no cuBLAS
    headers anywhere) becomes a CPU-only build with the reason said, unless FORCE_CUDA=1.
    """
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
    nvcc = nvcc_version(cuda_home)
    if nvcc and nvcc.split(".")[0] != torch.version.cuda.split(".")[0]:
        note = cuda_version_note(nvcc, torch.version.cuda, cuda_home)
        if force:
            raise RuntimeError(f"FORCE_CUDA=1 but {note}")
        return False, f"WARNING: {note}"
    if not force and not (Path(cuda_home) / "include" / "cublas_v2.h").exists() and not cublas_include_dirs():
        return False, (
            f"WARNING: no cuBLAS headers (cublas_v2.h) in the toolkit at {cuda_home} nor in "
            "site-packages/nvidia/*/include: building CPU-only. Fix: pip install the "
            f"nvidia-cublas wheel of torch's CUDA {torch.version.cuda}, or a toolkit with cuBLAS"
        )
    why = "FORCE_CUDA=1" if force else f"torch {torch.__version__} and a CUDA toolkit at {cuda_home}"
    if nvcc and nvcc != ".".join(torch.version.cuda.split(".")[:2]):
        why += f" (nvcc {nvcc}, torch's CUDA {torch.version.cuda})"
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


def cuda_fallback_note(build, error: BaseException) -> str | None:
    """What to say when ``build``'s CUDA compile failed and a CPU-only build is tried
    instead; None when that must not happen (a CPU build failed, or FORCE_CUDA=1)."""
    if not build.with_cuda or os.environ.get("FORCE_CUDA") == "1":
        return None
    if getattr(error, "missing", "a successful compile") not in ("a successful compile", "cuBLAS headers"):
        return None  # e.g. no ninja: a CPU build would fail the same way
    error = error.__cause__ or error
    last = [line for line in str(error).splitlines() if line.strip()][-3:]
    return (
        f"WARNING: the CUDA build failed ({build.reason}); building the CPU-only extension "
        "instead (no CUDA kernels; the guard runs on CPU tensors). The compiler said, last: "
        + " | ".join(last)
        + (f". {build.notes[0]}" if build.notes else "")
        + ". FORCE_CUDA=1 makes this an error; CUBLAS_GUARD_EXT_VERBOSE_BUILD=1 shows the full log"
    )


# A JIT CUDA build that failed leaves this file in its build directory, so that the next
# import goes straight to the CPU build instead of failing the same compile again; a
# source newer than it (an edit, a git pull) or its removal makes the next import retry.
CUDA_FAILED_MARKER = "cublas_guard_ext_cuda_build_failed.txt"


def record_cuda_failure(build_directory: str, note: str) -> None:
    try:
        os.makedirs(build_directory, exist_ok=True)
        Path(build_directory, CUDA_FAILED_MARKER).write_text(note + "\n")
    except OSError:
        pass  # only a cache: the next import retries the CUDA build


def cuda_failed_before(inputs: list[str], build_directory: str) -> str | None:
    """The marker's path if a CUDA build failed in ``build_directory`` after the newest
    of ``inputs`` (the sources and headers) was last changed."""
    marker = os.path.join(build_directory, CUDA_FAILED_MARKER)
    try:
        failed_at = os.path.getmtime(marker)
    except OSError:
        return None
    newest = max((os.path.getmtime(p) for p in inputs if os.path.exists(p)), default=0.0)
    return marker if newest < failed_at else None
