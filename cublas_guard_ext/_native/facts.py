"""Facts about this process's CUDA/cuBLAS environment, and the checks on them.

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
from dataclasses import asdict, dataclass
from typing import Any

import torch

ENV_VARS = (
    "CUDA_LAUNCH_BLOCKING",
    "CUBLAS_WORKSPACE_CONFIG",
    "CUDA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUBLAS_GUARD_MODE",
    "TORCH_CUDA_ARCH_LIST",
)

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"


@dataclass
class Check:
    """One item of the doctor's checklist."""

    name: str
    status: str  # OK | WARN | FAIL | SKIP (could not be checked here)
    reason: str
    fix: str = ""


def _safe(fn, default=None):
    try:
        return fn()
    except Exception:  # a diagnostic must never raise
        return default


def native_build_info() -> dict[str, Any]:
    """The extension's own build facts (``cublas_guard::build_info``)."""
    from . import _loader

    info = _loader.info()
    facts = _safe(lambda: json.loads(torch.ops.cublas_guard.build_info()), {}) or {}
    facts.update(kind=info.kind, path=info.path, detail=info.detail)
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


def _version_from_path(path: str) -> str | None:
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


def _cuda_version_text(value: int | None) -> str:
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


def _workspace_bytes(config: str | None) -> int | None:
    """Bytes CUBLAS_WORKSPACE_CONFIG (":SIZE_KiB:COUNT" pairs) asks for, if set."""
    if not config:
        return None
    total = 0
    for size, count in re.findall(r":(\d+):(\d+)", config):
        total += int(size) * 1024 * int(count)
    return total or None


def checks(env: dict[str, Any] | None = None, probe: bool = True) -> list[Check]:
    """The seed's fallback checklist, item by item, plus the build's own facts."""
    env = env if env is not None else environment()
    ext = env["extension"]
    out: list[Check] = []

    built = str(ext.get("built_with_torch", "unknown"))
    if built == "unknown":
        out.append(Check("extension build", WARN, "the extension does not say which torch built it"))
    elif built.split("+")[0] != torch.__version__.split("+")[0]:
        out.append(Check(
            "extension build", FAIL,
            f"built against torch {built}, running torch {torch.__version__}",
            "rebuild: pip install --no-build-isolation -e .",
        ))
    else:
        out.append(Check("extension build", OK, f"{ext.get('kind')} build for torch {built} ({ext.get('path')})"))

    if not env["cuda_available"]:
        reason = "no GPU visible" if torch.version.cuda else f"torch {torch.__version__} is a CPU-only build"
        for name in ("GPU arch vs torch", "GPU arch vs extension", "driver vs runtime",
                     "cuBLAS libraries", "GPU memory", "live cuBLAS probe"):
            out.append(Check(name, SKIP, f"could not check: {reason}"))
    else:
        runtime = ext.get("cudart_runtime_version")
        driver = ext.get("driver_version")
        if not ext.get("cuda_compiled"):
            out.append(Check(
                "extension CUDA kernels", FAIL,
                "a GPU is visible but the extension was built without CUDA",
                "install a CUDA toolkit (nvcc) and rebuild: pip install --no-build-isolation -e .",
            ))
        if driver and runtime and driver < runtime:
            out.append(Check(
                "driver vs runtime", FAIL,
                f"driver supports CUDA {_cuda_version_text(driver)}, the runtime is "
                f"{_cuda_version_text(runtime)}",
                "update the NVIDIA driver, or install a torch built for an older CUDA",
            ))
        elif driver and runtime:
            out.append(Check(
                "driver vs runtime", OK,
                f"driver CUDA {_cuda_version_text(driver)} >= runtime {_cuda_version_text(runtime)} "
                f"(torch built with CUDA {env['torch_cuda']})",
            ))
        else:
            out.append(Check("driver vs runtime", WARN, "the driver or runtime version is unknown"))
        for device in env["devices"]:
            cc_text = device.get("compute_capability")
            if not cc_text:
                continue
            cc = tuple(int(v) for v in cc_text.split("."))
            status, reason = arch_support(cc, env["torch_arch_list"])
            out.append(Check(
                f"GPU arch vs torch (cuda:{device['index']})", status,
                f"{device.get('name')}: {reason}",
                "" if status == OK else "install a torch build that lists this GPU's arch",
            ))
            built_archs = [f"sm_{a.strip()[:-1]}" for a in str(ext.get("built_archs", "")).split(",") if a.strip()]
            if built_archs:
                # __CUDA_ARCH_LIST__ does not say whether PTX was embedded: count SASS only.
                status, reason = arch_support(cc, built_archs)
                out.append(Check(
                    f"GPU arch vs extension (cuda:{device['index']})", status, reason,
                    "" if status == OK else
                    f"rebuild: TORCH_CUDA_ARCH_LIST={cc_text} pip install --no-build-isolation -e .",
                ))
            free, total = device.get("free_memory"), device.get("total_memory")
            if free is not None and total:
                workspace = _workspace_bytes(env["env"].get("CUBLAS_WORKSPACE_CONFIG")) or 32 << 20
                needed = workspace + (64 << 20)
                status = FAIL if free < needed else WARN if free < 0.05 * total else OK
                out.append(Check(
                    f"GPU memory (cuda:{device['index']})", status,
                    f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB; torch holds "
                    f"{(device.get('torch_reserved') or 0) / 2**30:.2f} GiB reserved",
                    "" if status == OK else
                    "free memory: smaller batch, torch.cuda.empty_cache(), other processes (nvidia-smi)",
                ))
        libs = env["libraries"]
        cublas = [p for p in libs if re.search(r"libcublas\.so", os.path.basename(p))]
        cublas_lt = [p for p in libs if re.search(r"libcublasLt\.so", os.path.basename(p))]
        if len(cublas) > 1 or len(cublas_lt) > 1:
            out.append(Check("cuBLAS libraries", FAIL, f"several copies loaded: {cublas + cublas_lt}",
                             "remove the duplicate CUDA installs from LD_LIBRARY_PATH"))
        elif cublas and cublas_lt:
            pair = (_version_from_path(cublas[0]), _version_from_path(cublas_lt[0]))
            same_dir = os.path.dirname(cublas[0]) == os.path.dirname(cublas_lt[0])
            status = OK if same_dir and pair[0] == pair[1] else WARN
            out.append(Check(
                "cuBLAS libraries", status,
                f"libcublas {cublas[0]}, libcublasLt {cublas_lt[0]}"
                + ("" if status == OK else " (a mismatched pair is a known cause of cuBLAS failures)"),
                "" if status == OK else "make both come from the same CUDA release (check LD_LIBRARY_PATH)",
            ))
        else:
            out.append(Check("cuBLAS libraries", WARN, "libcublas is not loaded yet (no GEMM has run)"))
        if probe:
            out.append(_probe_cuda())

    out.append(_tf32_check(env))
    blocking = env["env"].get("CUDA_LAUNCH_BLOCKING")
    if not env["torch_cuda"]:
        out.append(Check("CUDA_LAUNCH_BLOCKING", SKIP,
                         f"not applicable: torch {env['torch']} is a CPU-only build (no CUDA kernels)"))
    elif blocking == "1":
        out.append(Check("CUDA_LAUNCH_BLOCKING", OK, "set: errors are raised at the kernel that failed"))
    else:
        # Not set is the normal (fast) setting: nothing to fix, so no fix line on an ok row.
        out.append(Check(
            "CUDA_LAUNCH_BLOCKING", OK,
            "not set (normal): an error from an earlier kernel surfaces at a later call; while "
            "debugging a cuBLAS error, rerun with CUDA_LAUNCH_BLOCKING=1",
        ))
    out.append(_mode_check())
    config = env["env"].get("CUBLAS_WORKSPACE_CONFIG")
    out.append(Check(
        "CUBLAS_WORKSPACE_CONFIG", OK,
        f"{config} ({(_workspace_bytes(config) or 0) >> 20} MiB of workspace)" if config
        else "not set (cuBLAS's default workspace)",
    ))
    return out


def _tf32_check(env: dict[str, Any]) -> Check:
    """TF32 only concerns GEMMs on a CUDA GPU: not applicable to a CPU-only torch."""
    if not env["torch_cuda"]:
        return Check("TF32", SKIP,
                     f"not applicable: torch {env['torch']} is a CPU-only build (TF32 is a GPU setting)")
    allow_tf32 = env["tf32"]["torch.backends.cuda.matmul.allow_tf32"]
    if allow_tf32:
        return Check("TF32", WARN, "TF32 GEMMs are on (faster, ~10-bit mantissa)",
                     "to rule TF32 out: torch.backends.cuda.matmul.allow_tf32 = False")
    return Check("TF32", OK, "TF32 GEMMs are off (exact float32)")


def _mode_check() -> Check:
    """CUBLAS_GUARD_MODE is read at every guarded call: a bad value breaks every SafeLinear."""
    from . import modes

    value = os.environ.get(modes.ENV_VAR)
    if value is None:
        return Check("CUBLAS_GUARD_MODE", OK, "not set: layers without their own mode use 'sync'")
    try:
        mode = modes._env_default()
    except ValueError as err:
        return Check(
            "CUBLAS_GUARD_MODE", FAIL,
            f"{str(err).removeprefix('cublas_guard_ext: ')}: every SafeLinear without its own "
            "mode raises ValueError",
            f"unset it or set one of {', '.join(sorted(modes.MODE_CODES))}",
        )
    return Check("CUBLAS_GUARD_MODE", OK, f"{value!r}: layers without their own mode use {mode!r}")


def summary(items: list[Check]) -> dict[str, int]:
    """Counts per status, as the doctor's last line and its JSON report them."""
    return {
        "failed": sum(c.status == FAIL for c in items),
        "warnings": sum(c.status == WARN for c in items),
        "skipped": sum(c.status == SKIP for c in items),
        "ok": sum(c.status == OK for c in items),
    }


def _probe_cuda() -> Check:
    """A small guarded GEMM on the current GPU: handle creation, kernels, cuBLAS."""
    from .errors import GuardError
    from .nn import SafeLinear

    try:
        layer = SafeLinear(64, 32, device="cuda", mode="sync", name="doctor-probe")
        x = torch.randn(16, 64, device="cuda")
        y = layer(x)
        torch.cuda.synchronize()
        ok = torch.allclose(y, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-4)
    except GuardError as err:
        return Check("live cuBLAS probe", FAIL, str(err).splitlines()[0], "see the error above")
    except Exception as err:  # a torch/CUDA error outside the guard
        return Check("live cuBLAS probe", FAIL, f"{type(err).__name__}: {str(err).splitlines()[0]}",
                     "rerun with CUDA_LAUNCH_BLOCKING=1")
    if not ok:
        return Check("live cuBLAS probe", FAIL, "the guarded GEMM disagrees with F.linear")
    return Check("live cuBLAS probe", OK, "a guarded 16x64x32 GEMM ran and matches F.linear")


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
            driver=_cuda_version_text(ext.get("driver_version")),
            runtime=_cuda_version_text(ext.get("cudart_runtime_version")),
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
    return context


_checked_devices: set[int] = set()
_checked_lock = threading.Lock()


def first_cuda_use(device: torch.device) -> None:
    """Once per device: warn when this GPU cannot run torch's or the extension's kernels."""
    index = device.index if device.index is not None else _safe(torch.cuda.current_device, 0)
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
            + "; ".join(problems) + ". Run `python -m cublas_guard_ext doctor`.",
            RuntimeWarning,
            stacklevel=3,
        )


def as_json(items: list[Check], env: dict[str, Any]) -> str:
    return json.dumps(
        {"summary": summary(items), "checks": [asdict(c) for c in items], "environment": env},
        indent=2,
        default=str,
    )
