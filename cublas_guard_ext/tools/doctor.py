"""``python -m cublas_guard_ext doctor``: the first thing to run after a cuBLAS error.

Reports the environment (torch, CUDA driver/runtime, cuBLAS version and the
libraries actually loaded, GPUs and their memory, TF32, the relevant
environment variables, how the extension was built) and evaluates the
checklist item by item: OK / WARN / FAIL with the reason and the fix, SKIP
for what this machine cannot check (e.g. no GPU). Exit status 1 on any FAIL.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .. import capsule as _capsule
from .. import modes
from .._native import facts
from .._native.facts import FAIL, OK, SKIP, WARN
from ..errors import GuardError
from ..nn import SafeLinear


@dataclass
class Check:
    """One item of the doctor's checklist."""

    name: str
    status: str  # OK | WARN | FAIL | SKIP (could not be checked here)
    reason: str
    fix: str = ""


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
    env = env if env is not None else facts.environment()
    ext = env["extension"]
    out: list[Check] = []

    built = str(ext.get("built_with_torch", "unknown"))
    if built == "unknown":
        out.append(Check("extension build", WARN, "the extension does not say which torch built it"))
    elif built.split("+")[0] != torch.__version__.split("+")[0]:
        out.append(
            Check(
                "extension build",
                FAIL,
                f"built against torch {built}, running torch {torch.__version__}",
                "rebuild: pip install --no-build-isolation -e .",
            )
        )
    else:
        out.append(
            Check("extension build", OK, f"{ext.get('kind')} build for torch {built} ({ext.get('path')})")
        )

    if not env["cuda_available"]:
        reason = "no GPU visible" if torch.version.cuda else f"torch {torch.__version__} is a CPU-only build"
        for name in (
            "GPU arch vs torch",
            "GPU arch vs extension",
            "driver vs runtime",
            "cuBLAS libraries",
            "GPU memory",
            "live cuBLAS probe",
        ):
            out.append(Check(name, SKIP, f"could not check: {reason}"))
    else:
        runtime = ext.get("cudart_runtime_version")
        driver = ext.get("driver_version")
        if not ext.get("cuda_compiled"):
            out.append(
                Check(
                    "extension CUDA kernels",
                    FAIL,
                    "a GPU is visible but the extension was built without CUDA",
                    "install a CUDA toolkit (nvcc) and rebuild: pip install --no-build-isolation -e .",
                )
            )
        if driver and runtime and driver < runtime:
            out.append(
                Check(
                    "driver vs runtime",
                    FAIL,
                    f"driver supports CUDA {facts.cuda_version_text(driver)}, the runtime is "
                    f"{facts.cuda_version_text(runtime)}",
                    "update the NVIDIA driver, or install a torch built for an older CUDA",
                )
            )
        elif driver and runtime:
            out.append(
                Check(
                    "driver vs runtime",
                    OK,
                    f"driver CUDA {facts.cuda_version_text(driver)} >= runtime "
                    f"{facts.cuda_version_text(runtime)} "
                    f"(torch built with CUDA {env['torch_cuda']})",
                )
            )
        else:
            out.append(Check("driver vs runtime", WARN, "the driver or runtime version is unknown"))
        for device in env["devices"]:
            cc_text = device.get("compute_capability")
            if not cc_text:
                continue
            cc = tuple(int(v) for v in cc_text.split("."))
            status, reason = facts.arch_support(cc, env["torch_arch_list"])
            out.append(
                Check(
                    f"GPU arch vs torch (cuda:{device['index']})",
                    status,
                    f"{device.get('name')}: {reason}",
                    "" if status == OK else "install a torch build that lists this GPU's arch",
                )
            )
            built_archs = [
                f"sm_{a.strip()[:-1]}" for a in str(ext.get("built_archs", "")).split(",") if a.strip()
            ]
            if built_archs:
                # __CUDA_ARCH_LIST__ does not say whether PTX was embedded: count SASS only.
                status, reason = facts.arch_support(cc, built_archs)
                out.append(
                    Check(
                        f"GPU arch vs extension (cuda:{device['index']})",
                        status,
                        reason,
                        ""
                        if status == OK
                        else f"rebuild: TORCH_CUDA_ARCH_LIST={cc_text} pip install --no-build-isolation -e .",
                    )
                )
            free, total = device.get("free_memory"), device.get("total_memory")
            if free is not None and total:
                workspace = _workspace_bytes(env["env"].get("CUBLAS_WORKSPACE_CONFIG")) or 32 << 20
                needed = workspace + (64 << 20)
                status = FAIL if free < needed else WARN if free < 0.05 * total else OK
                out.append(
                    Check(
                        f"GPU memory (cuda:{device['index']})",
                        status,
                        f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB; torch holds "
                        f"{(device.get('torch_reserved') or 0) / 2**30:.2f} GiB reserved",
                        ""
                        if status == OK
                        else "free memory: smaller batch, torch.cuda.empty_cache(), other processes (nvidia-smi)",
                    )
                )
        libs = env["libraries"]
        cublas = [p for p in libs if re.search(r"libcublas\.so", os.path.basename(p))]
        cublas_lt = [p for p in libs if re.search(r"libcublasLt\.so", os.path.basename(p))]
        if len(cublas) > 1 or len(cublas_lt) > 1:
            out.append(
                Check(
                    "cuBLAS libraries",
                    FAIL,
                    f"several copies loaded: {cublas + cublas_lt}",
                    "remove the duplicate CUDA installs from LD_LIBRARY_PATH",
                )
            )
        elif cublas and cublas_lt:
            pair = (facts.version_from_path(cublas[0]), facts.version_from_path(cublas_lt[0]))
            same_dir = os.path.dirname(cublas[0]) == os.path.dirname(cublas_lt[0])
            status = OK if same_dir and pair[0] == pair[1] else WARN
            out.append(
                Check(
                    "cuBLAS libraries",
                    status,
                    f"libcublas {cublas[0]}, libcublasLt {cublas_lt[0]}"
                    + ("" if status == OK else " (a mismatched pair is a known cause of cuBLAS failures)"),
                    ""
                    if status == OK
                    else "make both come from the same CUDA release (check LD_LIBRARY_PATH)",
                )
            )
        else:
            out.append(Check("cuBLAS libraries", WARN, "libcublas is not loaded yet (no GEMM has run)"))
        if probe:
            out.append(_probe_cuda())

    out.append(_tf32_check(env))
    blocking = env["env"].get("CUDA_LAUNCH_BLOCKING")
    if not env["torch_cuda"]:
        out.append(
            Check(
                "CUDA_LAUNCH_BLOCKING",
                SKIP,
                f"not applicable: torch {env['torch']} is a CPU-only build (no CUDA kernels)",
            )
        )
    elif blocking == "1":
        out.append(Check("CUDA_LAUNCH_BLOCKING", OK, "set: errors are raised at the kernel that failed"))
    else:
        # Not set is the normal (fast) setting: nothing to fix, so no fix line on an ok row.
        out.append(
            Check(
                "CUDA_LAUNCH_BLOCKING",
                OK,
                "not set (normal): an error from an earlier kernel surfaces at a later call; while "
                "debugging a cuBLAS error, rerun with CUDA_LAUNCH_BLOCKING=1",
            )
        )
    out.append(_mode_check())
    config = env["env"].get("CUBLAS_WORKSPACE_CONFIG")
    out.append(
        Check(
            "CUBLAS_WORKSPACE_CONFIG",
            OK,
            f"{config} ({(_workspace_bytes(config) or 0) >> 20} MiB of workspace)"
            if config
            else "not set (cuBLAS's default workspace)",
        )
    )
    out += checks_2026(env)
    return out


# ---------------------------------------------------------------------------
# 2026's causes of CUBLAS_STATUS_EXECUTION_FAILED / NOT_SUPPORTED reports
# ---------------------------------------------------------------------------
def cublas_facts() -> dict[str, Any]:
    """The facts the 2026 checks read: the nvidia-cublas wheel torch pins and the one
    installed, the libcublas/libcublasLt versions actually loaded."""
    out: dict[str, Any] = {"torch_requires": None, "installed": None, "loaded": {}}
    try:
        from importlib import metadata

        for req in metadata.requires("torch") or []:
            match = re.match(r"\s*(nvidia-cublas(?:-cu\d+)?)\s*==\s*([\w.]+)", req)
            if match:
                out["torch_requires"] = {"name": match.group(1), "version": match.group(2)}
        name = (out["torch_requires"] or {}).get("name")
        for candidate in ([name] if name else []) + [
            "nvidia-cublas",
            "nvidia-cublas-cu12",
            "nvidia-cublas-cu13",
        ]:
            try:
                out["installed"] = {"name": candidate, "version": metadata.version(candidate)}
                break
            except metadata.PackageNotFoundError:
                continue
    except Exception:  # a diagnostic never raises
        pass
    for key, entries in _capsule.loaded_cublas().items():
        if isinstance(entries, list) and entries:
            out["loaded"][key] = entries[0]["version"]
    return out


def _version_tuple(text: Any, parts: int = 3) -> tuple[int, ...] | None:
    numbers = re.findall(r"\d+", str(text or ""))
    return tuple(int(n) for n in numbers[:parts]) if numbers else None


def _workspace_config_parts(config: str) -> list[tuple[int, int]] | None:
    if not re.fullmatch(r"(:\d+:\d+)+", config.strip()):
        return None
    return [(int(a), int(b)) for a, b in re.findall(r":(\d+):(\d+)", config)]


def checks_2026(env: dict[str, Any]) -> list[Check]:
    """The wheel torch pins vs the one installed and loaded, libcublas vs libcublasLt, GPUs
    CUDA 13 dropped, workspace settings on Hopper and newer."""
    out: list[Check] = []
    cublas = env.get("cublas")
    if cublas is not None:  # the library facts (cublas_facts(); main() gathers them)
        out += _library_checks(env, cublas)
    out += _gpu_and_workspace_checks(env)
    return out


def _library_checks(env: dict[str, Any], cublas: dict[str, Any]) -> list[Check]:
    out: list[Check] = []
    required, installed, loaded = (
        cublas.get("torch_requires"),
        cublas.get("installed"),
        cublas.get("loaded") or {},
    )
    if not env.get("torch_cuda"):
        out.append(
            Check(
                "cuBLAS wheel vs torch", SKIP, f"not applicable: torch {env.get('torch')} is a CPU-only build"
            )
        )
    elif not required:
        out.append(
            Check(
                "cuBLAS wheel vs torch",
                SKIP,
                "could not check: torch's metadata pins no nvidia-cublas wheel (a conda or "
                "system CUDA install)",
            )
        )
    else:
        want = _version_tuple(required["version"])
        have = _version_tuple((installed or {}).get("version"))
        running = _version_tuple(loaded.get("libcublas"))
        fix = f"pip install {required['name']}=={required['version']}"
        if have is None:
            out.append(
                Check(
                    "cuBLAS wheel vs torch",
                    WARN,
                    f"torch pins {required['name']}=={required['version']} but it is not installed",
                    fix,
                )
            )
        elif have != want:
            out.append(
                Check(
                    "cuBLAS wheel vs torch",
                    FAIL,
                    f"{installed['name']} {installed['version']} is installed, torch was built with "
                    f"{required['version']} (a mismatched cuBLAS is behind the 2026 EXECUTION_FAILED "
                    "reports fixed by upgrading it: pytorch/pytorch#174949, #180713)",
                    fix,
                )
            )
        elif running is not None and running != want[: len(running)]:
            out.append(
                Check(
                    "cuBLAS wheel vs torch",
                    FAIL,
                    f"the wheel matches torch ({required['version']}) but the libcublas loaded is "
                    f"{loaded.get('libcublas')}: another copy comes first (LD_LIBRARY_PATH?)",
                    "remove other CUDA libraries from LD_LIBRARY_PATH",
                )
            )
        else:
            out.append(
                Check(
                    "cuBLAS wheel vs torch",
                    OK,
                    f"{installed['name']} {installed['version']} as torch pins"
                    + (f", loaded {loaded['libcublas']}" if loaded.get("libcublas") else ""),
                )
            )
    lib, lt = loaded.get("libcublas"), loaded.get("libcublasLt")
    if lib and lt:
        same = _version_tuple(lib) == _version_tuple(lt)
        out.append(
            Check(
                "libcublas vs libcublasLt",
                OK if same else FAIL,
                f"libcublas {lib}, libcublasLt {lt}"
                + ("" if same else ": two releases mixed (every cuBLAS call goes through both)"),
                ""
                if same
                else "install one nvidia-cublas wheel and drop the other copy from LD_LIBRARY_PATH",
            )
        )
    else:
        out.append(
            Check(
                "libcublas vs libcublasLt",
                SKIP,
                "could not check: " + ("libcublas is not loaded" if not lib else "libcublasLt is not loaded"),
            )
        )
    return out


def _gpu_and_workspace_checks(env: dict[str, Any]) -> list[Check]:
    out: list[Check] = []
    cuda_major = (_version_tuple(env.get("torch_cuda"), 1) or (0,))[0]
    for device in env.get("devices") or [] if env.get("torch_cuda") else []:
        cc = _version_tuple(device.get("compute_capability"), 2)
        if not cc:
            continue
        name = f"GPU vs CUDA {cuda_major} (cuda:{device.get('index')})"
        arch = f"sm_{cc[0]}{cc[1] if len(cc) > 1 else 0}"
        listed = any(
            a.startswith(arch) or a == f"compute_{arch[3:]}" for a in env.get("torch_arch_list") or []
        )
        if cuda_major >= 13 and cc < (7, 5):
            out.append(
                Check(
                    name,
                    FAIL,
                    f"{device.get('name')} is compute capability {device.get('compute_capability')}: CUDA 13 "
                    "builds no longer cover GPUs below 7.5 (Maxwell, Pascal, Volta)",
                    "install a torch built with CUDA 12.x (e.g. the cu126 or cu128 wheels)",
                )
            )
        elif not listed:
            out.append(
                Check(
                    name,
                    WARN,
                    f"{arch} is not in torch's arch list {env.get('torch_arch_list')}",
                    "install a torch build whose arch list has this GPU, or build from source with "
                    f"TORCH_CUDA_ARCH_LIST={device.get('compute_capability')}",
                )
            )
        else:
            out.append(Check(name, OK, f"{arch} is supported and in torch's arch list"))
    config = (env.get("env") or {}).get("CUBLAS_WORKSPACE_CONFIG")
    lt_size = (env.get("env") or {}).get("CUBLASLT_WORKSPACE_SIZE")
    newest = max(
        (_version_tuple(d.get("compute_capability"), 2) or (0,) for d in env.get("devices") or []),
        default=None,
    )
    problems, fix = [], ""
    if config:
        parts = _workspace_config_parts(config)
        if parts is None:
            out.append(
                Check(
                    "cuBLAS workspace settings",
                    FAIL,
                    f"CUBLAS_WORKSPACE_CONFIG={config!r} is not ':SIZE_KiB:COUNT[:SIZE:COUNT...]'",
                    "fix it, e.g. CUBLAS_WORKSPACE_CONFIG=:4096:8, or unset it",
                )
            )
            return out
        if all(size == 0 for size, _ in parts):
            problems.append("CUBLAS_WORKSPACE_CONFIG gives cuBLAS no workspace at all")
        elif newest is not None and newest >= (9, 0) and max(size for size, _ in parts) < 32768:
            problems.append(
                f"CUBLAS_WORKSPACE_CONFIG={config} gives at most "
                f"{max(size for size, _ in parts) >> 10} MiB per call; cuBLAS on Hopper and "
                "newer (compute capability 9.0+) wants 32 MiB"
            )
            fix = "CUBLAS_WORKSPACE_CONFIG=:32768:2 (or unset it: torch's default is 32 MiB there)"
    if lt_size:
        if not lt_size.strip().isdigit():
            problems.append(f"CUBLASLT_WORKSPACE_SIZE={lt_size!r} is not a size in KiB")
        elif newest is not None and newest >= (9, 0) and int(lt_size) < 32768:
            problems.append(
                f"torch's cuBLASLt workspace (CUBLASLT_WORKSPACE_SIZE={lt_size} KiB) is below "
                "the 32 MiB cuBLASLt wants on compute capability 9.0+"
            )
            fix = fix or "raise CUBLASLT_WORKSPACE_SIZE to 32768, or unset it"
    if problems:
        out.append(
            Check(
                "cuBLAS workspace settings",
                WARN,
                "; ".join(problems),
                fix or "unset CUBLAS_WORKSPACE_CONFIG to give cuBLAS its default workspace",
            )
        )
    else:
        out.append(
            Check(
                "cuBLAS workspace settings",
                OK,
                "defaults"
                if not (config or lt_size)
                else f"CUBLAS_WORKSPACE_CONFIG={config}, CUBLASLT_WORKSPACE_SIZE={lt_size}",
            )
        )
    return out


# The capsule's environment facts compared with this machine's, by name.
_CAPSULE_FACTS = (
    ("torch", lambda e: e.get("torch")),
    ("torch's CUDA", lambda e: e.get("torch_cuda")),
    ("CUDA runtime", lambda e: e.get("cuda_runtime")),
    ("driver", lambda e: e.get("driver")),
    ("libcublas", lambda e: _lib_versions(e, "libcublas")),
    ("libcublasLt", lambda e: _lib_versions(e, "libcublasLt")),
    ("GPU", lambda e: (e.get("gpu") or {}).get("name")),
    ("compute capability", lambda e: (e.get("gpu") or {}).get("compute_capability")),
    ("torch arch list", lambda e: " ".join(e.get("torch_arch_list") or [])),
    ("TF32", lambda e: (e.get("tf32") or {}).get("allow_tf32")),
    ("extension build", lambda e: (e.get("extension") or {}).get("kind")),
)


def _lib_versions(env: dict[str, Any], key: str) -> str:
    entry = (env.get("libraries") or {}).get(key)
    return ", ".join(str(e.get("version")) for e in entry) if isinstance(entry, list) else str(entry)


def capsule_checks(recorded: dict[str, Any], here: dict[str, Any]) -> list[Check]:
    """This machine against a capsule's environment: one WARN per fact that differs."""
    out = []
    for name, get in _CAPSULE_FACTS:
        then, now = get(recorded), get(here)
        if then != now:
            out.append(
                Check(
                    f"capsule: {name}",
                    WARN,
                    f"the capsule's {then!r}, here {now!r}",
                    "replay the capsule on the machine it came from, or expect a different result",
                )
            )
    variables = sorted(set(recorded.get("env") or {}) | set(here.get("env") or {}))
    for var in variables:
        then, now = (recorded.get("env") or {}).get(var), (here.get("env") or {}).get(var)
        if then != now:
            out.append(
                Check(
                    f"capsule: {var}",
                    WARN,
                    f"the capsule's {then!r}, here {now!r}",
                    f"set {var} as the capsule had it to compare like with like",
                )
            )
    if not out:
        out.append(Check("capsule environment", OK, "this machine matches the capsule's environment"))
    return out


def _tf32_check(env: dict[str, Any]) -> Check:
    """TF32 only concerns GEMMs on a CUDA GPU: not applicable to a CPU-only torch."""
    if not env["torch_cuda"]:
        return Check(
            "TF32", SKIP, f"not applicable: torch {env['torch']} is a CPU-only build (TF32 is a GPU setting)"
        )
    allow_tf32 = env["tf32"]["torch.backends.cuda.matmul.allow_tf32"]
    if allow_tf32:
        return Check(
            "TF32",
            WARN,
            "TF32 GEMMs are on (faster, ~10-bit mantissa)",
            "to rule TF32 out: torch.backends.cuda.matmul.allow_tf32 = False",
        )
    return Check("TF32", OK, "TF32 GEMMs are off (exact float32)")


def _mode_check() -> Check:
    """CUBLAS_GUARD_MODE is read at every guarded call: a bad value breaks every SafeLinear."""
    value = os.environ.get(modes.ENV_VAR)
    if value is None:
        return Check("CUBLAS_GUARD_MODE", OK, "not set: layers without their own mode use 'sync'")
    try:
        mode = modes._env_default()
    except ValueError as err:
        return Check(
            "CUBLAS_GUARD_MODE",
            FAIL,
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
    try:
        layer = SafeLinear(64, 32, device="cuda", mode="sync", name="doctor-probe")
        x = torch.randn(16, 64, device="cuda")
        y = layer(x)
        torch.cuda.synchronize()
        ok = torch.allclose(y, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-4)
    except GuardError as err:
        return Check("live cuBLAS probe", FAIL, str(err).splitlines()[0], "see the error above")
    except Exception as err:  # a torch/CUDA error outside the guard
        return Check(
            "live cuBLAS probe",
            FAIL,
            f"{type(err).__name__}: {str(err).splitlines()[0]}",
            "rerun with CUDA_LAUNCH_BLOCKING=1",
        )
    if not ok:
        return Check("live cuBLAS probe", FAIL, "the guarded GEMM disagrees with F.linear")
    return Check("live cuBLAS probe", OK, "a guarded 16x64x32 GEMM ran and matches F.linear")


def report_json(items: list[Check], env: dict[str, Any]) -> str:
    return json.dumps(
        {"summary": summary(items), "checks": [asdict(c) for c in items], "environment": env},
        indent=2,
        default=str,
    )


_MARK = {"OK": "ok  ", "WARN": "WARN", "FAIL": "FAIL", "SKIP": "skip"}


def render(items: list[Check], env: dict) -> str:
    ext = env["extension"]
    lines = [
        "cublas_guard_ext doctor",
        f"  python {env['python']} on {env['platform']}",
        f"  torch {env['torch']} (CUDA {env['torch_cuda'] or 'none'}), arch list: "
        f"{' '.join(env['torch_arch_list']) or '-'}",
        f"  extension: {ext.get('kind')} ({ext.get('detail')}), built with torch "
        f"{ext.get('built_with_torch')}, CUDA kernels: {bool(ext.get('cuda_compiled'))}"
        + (f", archs {ext.get('built_archs')}" if ext.get("built_archs") else ""),
    ]
    if ext.get("cuda_compiled"):
        lines.append(
            f"  CUDA driver {facts.cuda_version_text(ext.get('driver_version'))}, runtime "
            f"{facts.cuda_version_text(ext.get('cudart_runtime_version'))}, cuBLAS "
            f"{ext.get('cublas_runtime_version', 'unknown')}"
        )
    for lib in env["libraries"]:
        lines.append(f"  loaded: {lib}")
    for device in env["devices"]:
        lines.append(
            f"  cuda:{device['index']}: {device.get('name')} (sm {device.get('compute_capability')}), "
            f"{(device.get('free_memory') or 0) / 2**30:.2f} / "
            f"{(device.get('total_memory') or 0) / 2**30:.2f} GiB free"
        )
    set_vars = {k: v for k, v in env["env"].items() if v is not None}
    lines.append(f"  environment: {set_vars or 'none of ' + ', '.join(facts.ENV_VARS)}")
    lines.append("")
    width = max(len(c.name) for c in items)
    for check in items:
        lines.append(f"[{_MARK[check.status]}] {check.name:<{width}}  {check.reason}")
        if check.fix:
            lines.append(f"       {'':<{width}}  fix: {check.fix}")
    counts = summary(items)
    lines.append("")
    lines.append(
        f"{counts['failed']} failed, {counts['warnings']} warnings, {counts['skipped']} not checkable "
        f"or not applicable here, {counts['ok']} ok"
    )
    return "\n".join(lines)


def main(as_json: bool = False, probe: bool = True, capsule: str | None = None) -> int:
    env = facts.environment()
    env.setdefault("cublas", cublas_facts())
    env.setdefault("env", {})
    env["env"].setdefault("CUBLASLT_WORKSPACE_SIZE", os.environ.get("CUBLASLT_WORKSPACE_SIZE"))
    items = checks(env, probe=probe)
    if capsule is not None:
        try:
            recorded = _capsule.load(capsule)
        except Exception as err:  # a missing or foreign file is one FAIL row, not a traceback
            items.append(Check("capsule", FAIL, f"cannot read {capsule}: {err}"))
        else:
            env["capsule"] = {"path": capsule, "environment": recorded.get("environment")}
            items += capsule_checks(recorded.get("environment") or {}, _capsule.environment())
    print(report_json(items, env) if as_json else render(items, env))
    return 1 if any(c.status == "FAIL" for c in items) else 0


if __name__ == "__main__":
    sys.exit(main("--json" in sys.argv))
