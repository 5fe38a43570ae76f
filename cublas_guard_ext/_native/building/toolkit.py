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
import sys
import sysconfig
import tempfile
from pathlib import Path

# Set to 1, the build looks only at pip's CUDA toolkit (site-packages/nvidia/cuNN), never a
# system one (CUDA_HOME, /usr/local/cuda, nvcc on PATH): how CI proves the pip-only setup on a
# machine that has a system toolkit too.
IGNORE_SYSTEM_CUDA_ENV = "CUBLAS_GUARD_EXT_IGNORE_SYSTEM_CUDA"
# The pip toolkit's extras that a CUDA build of the extension needs: nvcc (with the runtime,
# the crt headers and nvvm) and cccl (cub/thrust/libcu++, which ATen's CUDA headers include).
PIP_TOOLKIT_EXTRAS = "nvcc,cccl"


def _is_toolkit(root: str | None) -> bool:
    return bool(
        root
        and (Path(root) / "bin" / "nvcc").exists()
        and (Path(root) / "include" / "cuda_runtime.h").exists()
    )


def _site_dirs() -> list[str]:
    """The folders pip installs into for this interpreter (purelib, platlib, then sys.path's)."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    return list(dict.fromkeys(d for d in dirs if d))


def find_pip_toolkit(torch_cuda: str | None) -> str | None:
    """pip's CUDA toolkit of torch's CUDA major (``site-packages/nvidia/cu13`` from
    ``pip install "cuda-toolkit[nvcc,cccl]==..."``): its root when it has nvcc, else None."""
    if not torch_cuda:
        return None
    major = torch_cuda.split(".")[0]
    for base in _site_dirs():
        root = os.path.join(base, "nvidia", f"cu{major}")
        if _is_toolkit(root):
            return root
    return None


def find_cuda_home() -> str | None:
    """A CUDA toolkit root with bin/nvcc and include/cuda_runtime.h, if any.

    torch's own guess can be a wrapper's prefix (``/usr/local`` when
    ``/usr/local/bin/nvcc`` is a script), so every candidate is verified. A system
    toolkit comes first (CUDA_HOME, CUDA_PATH, torch's guess, /usr/local/cuda, nvcc on
    PATH); without one, pip's toolkit of torch's CUDA major (find_pip_toolkit).
    """
    from torch.utils import cpp_extension

    candidates: list[str | None] = []
    if os.environ.get(IGNORE_SYSTEM_CUDA_ENV) != "1":
        candidates += [
            os.environ.get("CUDA_HOME"),
            os.environ.get("CUDA_PATH"),
            cpp_extension.CUDA_HOME,
            "/usr/local/cuda",
        ]
        nvcc = shutil.which("nvcc")
        if nvcc:
            candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    for root in candidates:
        if _is_toolkit(root):
            return root
    return find_pip_toolkit(_torch_cuda())


def _torch_cuda() -> str | None:
    import torch

    return torch.version.cuda


def cudart_link_name(cuda_home: str) -> str | None:
    """``:libcudart.so.13`` when ``cuda_home`` ships only the versioned runtime (pip's
    nvidia-cuda-runtime has no unversioned ``libcudart.so``, so torch's ``-lcudart`` cannot
    link); None when ``-lcudart`` finds a library."""
    for lib in ("lib64", "lib"):
        if (Path(cuda_home) / lib / "libcudart.so").exists():
            return None
    for lib in ("lib64", "lib"):
        versioned = sorted(glob.glob(os.path.join(cuda_home, lib, "libcudart.so.[0-9]*")), key=len)
        if versioned:
            return ":" + os.path.basename(versioned[0])
    return None


def link_cudart_by_name(path: str, library: str) -> None:
    """In torch's build.ninja, link ``library`` (``:libcudart.so.13``) where torch wrote
    ``-lcudart``: pip's toolkit ships only the versioned runtime."""
    text = Path(path).read_text()
    new_text = re.sub(r"(?<=\s)-lcudart(?=\s|$)", f"-l{library}", text, flags=re.M)
    if new_text != text:
        Path(path).write_text(new_text)


# ---------------------------------------------------------------------------
# torch's CUDA pins (its metadata), and the one pip command that brings a toolkit
# ---------------------------------------------------------------------------
_PIN = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?\s*==\s*([0-9][\w.]*?)(?:\.\*)?\s*(?:;(.*))?$")


def _parse_pins(requires: list[str]) -> list[tuple[str, list[str], str, str]]:
    """(name, extras, version, marker) of every ``name[extras]==version`` requirement."""
    out = []
    for req in requires:
        match = _PIN.match(req)
        if match:
            extras = [e.strip() for e in (match.group(2) or "").split(",") if e.strip()]
            out.append(
                (match.group(1).lower().replace("_", "-"), extras, match.group(3), match.group(4) or "")
            )
    return out


def torch_cuda_pins(
    torch_requires: list[str] | None = None, toolkit_requires: list[str] | None = None
) -> dict[str, str]:
    """The CUDA versions torch's metadata pins: ``cuda-toolkit`` (the meta-package torch
    2.14+ pins, ``cuda-toolkit[cublas,cudart,...]==13.0.3``), and each nvidia wheel, read
    directly (``nvidia-cublas-cu12==...``, older torches) or through cuda-toolkit's own
    metadata for the extras torch asks for. Empty when torch pins nothing (a CPU, conda or
    source build). Both lists are read from the installed metadata when not given."""
    from importlib import metadata

    def requires_of(name: str) -> list[str]:
        try:
            return list(metadata.requires(name) or [])
        except metadata.PackageNotFoundError:
            return []

    pins: dict[str, str] = {}
    torch_extras: list[str] = []
    for name, extras, version, _marker in _parse_pins(
        torch_requires if torch_requires is not None else requires_of("torch")
    ):
        if name == "cuda-toolkit":
            pins["cuda-toolkit"] = version
            torch_extras = extras
        elif name.startswith("nvidia-"):
            pins[name] = version
    if "cuda-toolkit" in pins:
        for name, _extras, version, marker in _parse_pins(
            toolkit_requires if toolkit_requires is not None else requires_of("cuda-toolkit")
        ):
            extra = re.search(r"extra\s*==\s*['\"]([\w-]+)['\"]", marker)
            if extra and extra.group(1) in torch_extras and name not in pins:
                pins[name] = version
    return pins


def pip_toolkit_spec(pins: dict[str, str] | None = None, torch_cuda: str | None = None) -> str:
    """The requirement that brings the CUDA compiler and headers matching torch's CUDA
    (``cuda-toolkit[nvcc,cccl]==13.0.3``): the ``cuda-toolkit`` version torch pins, else its
    CUDA release."""
    pins = torch_cuda_pins() if pins is None else pins
    torch_cuda = torch_cuda if torch_cuda is not None else _torch_cuda()
    version = pins.get("cuda-toolkit")
    pin = f"=={version}" if version else f"=={'.'.join((torch_cuda or '13.0').split('.')[:2])}.*"
    return f"cuda-toolkit[{PIP_TOOLKIT_EXTRAS}]{pin}"


def pip_toolkit_command(pins: dict[str, str] | None = None, torch_cuda: str | None = None) -> str:
    """The one pip command that brings it (pip_toolkit_spec)."""
    return f'pip install "{pip_toolkit_spec(pins, torch_cuda)}"'


def missing_kernels_note(torch_cuda: str | None = None, why: str | None = None) -> str:
    """What to say when a CUDA torch gets an extension without CUDA kernels (at install, at
    the first CUDA call, in doctor): the same words and the same pip command everywhere."""
    why = why or "no CUDA toolkit (nvcc) was found when it was built"
    return (
        f"the extension has no CUDA kernels ({why}): CUDA tensors cannot go through it. Fix: "
        f"{pip_toolkit_command(torch_cuda=torch_cuda)} (the CUDA compiler matching torch's CUDA), "
        "then rebuild: pip install --no-build-isolation -e ."
    )


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
                f"found; set CUDA_HOME to the toolkit root, or {pip_toolkit_command(torch_cuda=torch.version.cuda)}"
            )
        return False, f"WARNING: {missing_kernels_note(torch.version.cuda)}"
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
