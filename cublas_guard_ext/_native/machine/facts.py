"""Facts about this process's CUDA/cuBLAS environment (the checklist on them is the doctor's).

Used by the doctor (``python -m cublas_guard_ext doctor``), by the cuBLAS
error messages (a short environment block) and once per device at the first
CUDA use (a warning when the setup cannot work). Everything here is best
effort: in a broken CUDA context a query fails, and the fact is reported as
unknown rather than raising.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import threading
import warnings
from typing import Any

import torch

from ...errors import base as _errors_base

ENV_VARS = (
    "CUDA_LAUNCH_BLOCKING",
    "CUBLAS_WORKSPACE_CONFIG",
    "CUDA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUBLAS_GUARD_MODE",
    "TORCH_CUDA_ARCH_LIST",
)

# The statuses of arch_support and of the doctor's checks.
OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"


def _safe(fn, default=None):
    try:
        return fn()
    except Exception:  # a diagnostic must never raise
        return default


def native_build_info() -> dict[str, Any]:
    """The extension's own build facts (``cublas_guard::build_info``)."""
    from ..loading import loader  # late: loading may build the library; facts must import cheaply

    info = loader.info()
    facts = _safe(lambda: json.loads(torch.ops.cublas_guard.build_info()), {}) or {}
    facts.update(kind=info.kind, path=info.path, detail=info.detail, library=info.library)
    return facts


def loaded_libraries(pattern: str = r"lib(cublas|cublasLt|cudart)[.-]") -> list[str]:
    """Paths of the shared libraries matching ``pattern`` mapped into this process."""
    paths: set[str] = set()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) == 6 and re.search(pattern, os.path.basename(parts[5].strip())):
                    paths.add(parts[5].strip())
    except OSError:
        pass
    return sorted(paths)


def version_from_path(path: str) -> str | None:
    match = re.search(r"\.so\.([\d.]+)$", path)
    return match.group(1) if match else None


def _cc(major: int, minor: int) -> int:
    return major * 10 + minor


def arch_support(cc: tuple[int, int], arch_list: list[str]) -> tuple[str, str]:
    """Whether an arch list (``sm_90``, ``compute_90`` style) runs on a GPU of ``cc``.

    Returns (status, reason): OK for a matching SASS (same major, minor not above
    the GPU's), WARN when only PTX of an older arch can be JIT-compiled, FAIL else.
    """
    device = _cc(*cc)
    sass, ptx = [], []
    for arch in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", arch)
        if not match:
            continue
        value = int(match.group(2)) * 10 + int(match.group(3))
        (sass if match.group(1) == "sm" else ptx).append(value)
    # SASS runs on the same major with an equal or higher minor.
    if any(v // 10 == device // 10 and v <= device for v in sass):
        return OK, f"sm_{device} is covered by {', '.join(arch_list)}"
    if any(v <= device for v in ptx):
        return WARN, (
            f"no SASS for sm_{device} in {', '.join(arch_list)}; PTX of an older arch is "
            "JIT-compiled at first use (slow start, may miss features)"
        )
    return FAIL, f"sm_{device} is not in {', '.join(arch_list) or '(empty list)'} and no PTX covers it"


def cuda_version_text(value: int | None) -> str:
    if not value:
        return "unknown"
    return f"{value // 1000}.{(value % 1000) // 10}"


def environment() -> dict[str, Any]:
    """Every fact the doctor reports, as plain data."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_arch_list": _safe(torch.cuda.get_arch_list, []),
        "cuda_available": _safe(torch.cuda.is_available, False),
        "tf32": {
            "torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
        },
        "env": {name: os.environ.get(name) for name in ENV_VARS},
        "extension": native_build_info(),
        "libraries": loaded_libraries(),
        "devices": [],
    }
    if env["cuda_available"]:
        for index in range(_safe(torch.cuda.device_count, 0)):
            props = _safe(lambda i=index: torch.cuda.get_device_properties(i))
            free_total = _safe(lambda i=index: torch.cuda.mem_get_info(i))
            device: dict[str, Any] = {"index": index}
            if props is not None:
                device.update(
                    name=props.name,
                    compute_capability=f"{props.major}.{props.minor}",
                    total_memory=props.total_memory,
                )
            if free_total is not None:
                device.update(free_memory=free_total[0], total_memory=free_total[1])
            device["torch_allocated"] = _safe(lambda i=index: torch.cuda.memory_allocated(i))
            device["torch_reserved"] = _safe(lambda i=index: torch.cuda.memory_reserved(i))
            env["devices"].append(device)
    return env


def error_context() -> dict[str, Any]:
    """The short environment block a cuBLAS/CUDA error carries."""
    ext = _safe(native_build_info, {}) or {}
    context: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "env": {k: v for k, v in ((n, os.environ.get(n)) for n in ENV_VARS[:2]) if v is not None},
    }
    if ext.get("cuda_compiled"):
        context.update(
            driver=cuda_version_text(ext.get("driver_version")),
            runtime=cuda_version_text(ext.get("cudart_runtime_version")),
            cublas=ext.get("cublas_runtime_version"),
            extension_archs=ext.get("built_archs"),
        )
        libs = [p for p in loaded_libraries(r"libcublas") if p]
        if libs:
            context["cublas_libraries"] = libs
    if _safe(torch.cuda.is_available, False):
        index = _safe(torch.cuda.current_device, 0)
        props = _safe(lambda: torch.cuda.get_device_properties(index))
        if props is not None:
            cc = (props.major, props.minor)
            context["gpu"] = f"{props.name}, compute capability {cc[0]}.{cc[1]}"
            context["arch_check"] = arch_support(cc, _safe(torch.cuda.get_arch_list, []))[1]
    # Read only here, when an error is built (the maps and LD_LIBRARY_PATH, nothing else):
    # two copies of a library, or libcublas and libcublasLt from two folders, come first
    # among a cuBLAS error's likely causes.
    from . import libraries

    conflicts = libraries.quick_conflicts()
    if conflicts:
        context["library_conflicts"] = [{"message": c["message"], "fix": c["fix"]} for c in conflicts]
    return context


def require_cuda_kernels() -> None:
    """Raise ExtensionBuildError, naming the pip command that brings a CUDA toolkit, when the
    loaded library has no CUDA kernel for ``cublas_guard::linear`` (built where no toolkit
    was found): the first CUDA call says why, instead of the dispatcher's "no kernel"."""
    if torch._C._dispatch_has_kernel_for_dispatch_key("cublas_guard::linear", "CUDA"):
        return
    from ...errors import ExtensionBuildError  # late: only where it is raised, as in the loader
    from ..building import toolkit

    info = native_build_info()
    if (
        info.get("library") == "core" and info.get("kind") == "prebuilt"
    ):  # the wheel's core, its CUDA part not for this torch
        # Two ways out: the CUDA wheel (no compiler), or a build here, which needs nvcc.
        fix = (
            f"install the cublas_guard_ext wheel built for CUDA {str(torch.version.cuda).split('.')[0]} "
            "(make wheel on a machine with CUDA torch, then pip install dist/*.whl), or build from a "
            "source checkout: "
            f"{toolkit.pip_toolkit_command(torch_cuda=torch.version.cuda)} when no nvcc is installed, "
            "then pip install --no-build-isolation -e ."
        )
    else:
        fix = toolkit.missing_kernels_note(
            torch.version.cuda, "it was built where no CUDA toolkit (nvcc) was found, or CPU-only on purpose"
        )
    raise ExtensionBuildError(
        missing="CUDA kernels",
        detail=f"the loaded extension ({info.get('kind')}: {info.get('path')}) was built without CUDA "
        f"({info.get('detail')}); torch {torch.__version__} runs CUDA {torch.version.cuda}",
        fix=fix,
    )


_checked_devices: set[int] = set()
_checked_lock = threading.Lock()


def first_cuda_use(device: torch.device) -> None:
    """Once per device: warn when this GPU cannot run torch's or the extension's kernels."""
    index = device.index if device.index is not None else _safe(torch.cuda.current_device, 0)
    require_cuda_kernels()
    with _checked_lock:
        if index in _checked_devices:
            return
        _checked_devices.add(index)
    props = _safe(lambda: torch.cuda.get_device_properties(index))
    if props is None:
        return
    cc = (props.major, props.minor)
    problems = []
    status, reason = arch_support(cc, _safe(torch.cuda.get_arch_list, []))
    if status == FAIL:
        problems.append(f"torch: {reason}")
    built = str(native_build_info().get("built_archs", ""))
    archs = [f"sm_{a.strip()[:-1]}" for a in built.split(",") if a.strip()]
    if archs:
        status, reason = arch_support(cc, archs)
        if status == FAIL:
            problems.append(f"cublas_guard_ext: {reason}")
    if problems:
        warnings.warn(
            f"cublas_guard_ext: cuda:{index} ({props.name}, sm_{cc[0]}{cc[1]}) cannot run: "
            + "; ".join(problems)
            + ". Run `python -m cublas_guard_ext doctor`.",
            RuntimeWarning,
            stacklevel=3,
        )


# The environment block of cuBLAS/CUDA errors: errors/ (the floor below) reads it through
# this function, handed in here because errors imports nothing of the package.
_errors_base.read_environment_with(error_context)
