"""What a capsule says about the machine: the Python, torch and extension builds, the cuBLAS
libraries mapped and where each came from, the nvidia wheels, TF32 settings, the relevant
environment variables and the GPU. The doctor compares a capsule's block with its own
(``doctor --capsule``)."""

from __future__ import annotations

import copy
import os
import platform
import re
import sys
from typing import Any

import torch

from .._native.machine import facts, libraries

# Variables that change what a GEMM does or how errors surface.
_RELEVANT_ENV = re.compile(
    r"^(CUDA_|CUBLAS|CUBLASLT_|NVIDIA_TF32|TORCH_CUDA_ARCH_LIST|PYTORCH_CUDA_ALLOC_CONF|"
    r"TORCH_BLAS|TORCH_CUBLAS|LD_LIBRARY_PATH$)"
)


def loaded_cublas() -> dict[str, Any]:
    """libcublas and libcublasLt as loaded in this process: path and version, or 'not loaded'."""
    out: dict[str, Any] = {}
    loaded = facts.loaded_libraries(r"libcublas")
    for key, pattern in (("libcublas", r"^libcublas\.so"), ("libcublasLt", r"^libcublasLt\.so")):
        paths = [p for p in loaded if re.search(pattern, os.path.basename(p))]
        if not paths:
            out[key] = "not loaded"
            continue
        out[key] = [{"path": p, "version": libraries._query_version(key, p) or "unknown"} for p in paths]
    return out


_WHEELS: dict[str, str] | None = None


def _nvidia_wheels() -> dict[str, str]:
    """Installed nvidia-cublas / nvidia-cuda-runtime wheels (their versions), read once per
    process (scanning every installed distribution takes ~0.1 s)."""
    global _WHEELS
    if _WHEELS is None:
        _WHEELS = _scan_wheels()
    return dict(_WHEELS)


def _scan_wheels() -> dict[str, str]:
    try:
        from importlib import metadata

        wheels = {}
        for dist in metadata.distributions():
            name = (dist.metadata.get("Name") or "").lower()
            if name.startswith("nvidia-cublas") or name.startswith("nvidia-cuda-runtime"):
                wheels[name] = dist.version
        return wheels
    except Exception:  # the error path must not fail
        return {}


def _loaded_libraries(own_path: str | None) -> dict[str, Any]:
    """Per library, the files mapped (path, version, pip distribution, the LD_LIBRARY_PATH
    entry that supplied it), and the conflicts' messages; no search for other copies."""
    snap = facts._safe(lambda: libraries.snapshot(own_path, with_installed=False), {}) or {}
    return {
        "loaded": snap.get("loaded", {}),
        "ld_library_path": snap.get("ld_library_path", []),
        "conflicts": [c["message"] for c in snap.get("conflicts", [])],
    }


_BUILD_INFO: dict[str, Any] | None = None  # the extension's build facts do not change

# The library facts of the last capsule, and what they were read from. Every failing call writes
# a capsule, and these facts cost ~5 ms a time (the maps parsed four times, every folder on
# sys.path listed for cuBLAS wheels), while they change only when a library is mapped or
# unmapped, LD_LIBRARY_PATH changes, or a wheel is installed or removed (its folder's mtime).
_LIBRARY_FACTS: tuple[tuple, dict[str, Any]] | None = None


def _library_facts_key(own_path: str | None) -> tuple:
    files = libraries.mapped_files()
    folders = []
    for folder in sys.path:
        try:
            folders.append((folder, os.stat(folder or ".").st_mtime_ns))
        except OSError:
            folders.append((folder, None))
    return (own_path, files, os.environ.get("LD_LIBRARY_PATH"), tuple(folders))


def _library_facts(own_path: str | None) -> dict[str, Any]:
    """loaded_cublas(), the loaded libraries and the nvidia wheels, read again only when what
    they are read from changed (a fresh copy each time: callers may edit theirs)."""
    global _LIBRARY_FACTS
    key = _library_facts_key(own_path)
    if _LIBRARY_FACTS is None or _LIBRARY_FACTS[0] != key:
        _LIBRARY_FACTS = (
            key,
            {
                "libraries": loaded_cublas(),
                "loaded_libraries": _loaded_libraries(own_path),
                "nvidia_wheels": _nvidia_wheels(),
            },
        )
    return copy.deepcopy(_LIBRARY_FACTS[1])


def environment() -> dict[str, Any]:
    """What the capsule says about the machine (the doctor compares it with its own)."""
    global _BUILD_INFO
    if _BUILD_INFO is None:
        _BUILD_INFO = facts._safe(facts.native_build_info, {}) or {}
    ext = _BUILD_INFO
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_arch_list": facts._safe(torch.cuda.get_arch_list, []),
        "extension": {
            k: ext.get(k)
            for k in (
                "kind",
                "built_with_torch",
                "cuda_compiled",
                "built_archs",
                "cuda_compiled_version",
                "cublas_header_version",
            )
        },
        "cuda_runtime": facts.cuda_version_text(ext.get("cudart_runtime_version"))
        if ext.get("cudart_runtime_version")
        else "not loaded (a CPU build of the extension)"
        if not ext.get("cuda_compiled")
        else "unknown",
        "driver": facts.cuda_version_text(ext.get("driver_version"))
        if ext.get("driver_version")
        else "unknown",
        "cublas_runtime_version": ext.get("cublas_runtime_version") or "not loaded",
        # loaded_cublas(), which file each CUDA library came from and the conflicts (doctor
        # --capsule compares them), the nvidia wheels:
        **_library_facts(ext.get("path")),
        "tf32": {
            "allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "allow_bf16_reduced_precision_reduction": bool(
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
            ),
            "allow_fp16_reduced_precision_reduction": bool(
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
            ),
        },
        "env": {k: v for k, v in sorted(os.environ.items()) if _RELEVANT_ENV.match(k)},
        "gpu": None,
    }
    if facts._safe(torch.cuda.is_available, False):
        index = facts._safe(torch.cuda.current_device, 0)
        props = facts._safe(lambda: torch.cuda.get_device_properties(index))
        if props is not None:
            env["gpu"] = {
                "index": index,
                "name": props.name,
                "compute_capability": f"{props.major}.{props.minor}",
                "total_memory": int(props.total_memory),
            }
    return env
