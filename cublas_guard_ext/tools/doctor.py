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
from dataclasses import asdict
from typing import Any

import torch

from .._native.machine import facts
from .._native.machine.facts import FAIL, OK, SKIP, WARN
from ..capsule import contents as _capsule
from ..errors import GuardError
from ..guarded_linear import modes
from ..guarded_linear.nn import SafeLinear
from .doctor_cublas import Check, capsule_checks, checks_2026, cublas_facts  # noqa: F401  (re-exported)
from .doctor_libraries import library_checks, library_facts, render_libraries


def _workspace_bytes(config: str | None) -> int | None:
    """Bytes CUBLAS_WORKSPACE_CONFIG (":SIZE_KiB:COUNT" pairs) asks for, if set."""
    if not config:
        return None
    total = 0
    for size, count in re.findall(r":(\d+):(\d+)", config):
        total += int(size) * 1024 * int(count)
    return total or None


def checks(env: dict[str, Any] | None = None, probe: bool = True) -> list[Check]:
    """The checklist for a cuBLAS failure (versions, build, devices, libraries), item by item,
    plus the build's own facts."""
    env = env if env is not None else facts.environment()
    ext = env["extension"]
    out: list[Check] = []

    built = str(ext.get("built_with_torch", "unknown"))
    if ext.get("library") == "core":
        floor = ext.get("stable_abi_floor", "?")
        out.append(
            Check(
                "extension build",
                OK,
                f"the stable core (every torch >= {floor}; {ext.get('detail')}), {ext.get('path')}; "
                f"watch needs the version-locked library: python -m cublas_guard_ext build",
            )
        )
    elif built == "unknown":
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
            "GPU memory",
            "live cuBLAS probe",
        ):
            out.append(Check(name, SKIP, f"could not check: {reason}"))
    else:
        runtime = ext.get("cudart_runtime_version")
        driver = ext.get("driver_version")
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
    out += library_checks(env)
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


def report_json(items: list[Check], env: dict[str, Any], steps: list[dict[str, str]] | None = None) -> str:
    return json.dumps(
        {
            "summary": summary(items),
            "checks": [asdict(c) for c in items],
            "environment": env,
            "next_steps": steps if steps is not None else next_steps(items, env),
        },
        indent=2,
        default=str,
    )


def next_steps(items: list[Check], env: dict[str, Any], capsule: str | None = None) -> list[dict[str, str]]:
    """What to run next, ready to paste, for this situation: [{"why", "command"}]. The
    fixes of the FAILs first, then the capsule's replay, then the CUDA debugging runs."""
    steps: list[dict[str, str]] = []
    # A conflict among the loaded libraries first: the other FAILs are often its symptoms.
    fails = sorted(
        (c for c in items if c.status == FAIL and c.fix),
        key=lambda c: not c.name.startswith("loaded libraries"),
    )
    for check in fails:
        if all(step["command"] != check.fix for step in steps):
            steps.append({"why": f"fix: {check.name}", "command": check.fix})
    recorded = capsule or _newest_capsule()
    if recorded:
        steps.append(
            {
                "why": "run the failing call alone: does it fail by itself?",
                "command": f"python -m cublas_guard_ext replay {recorded}",
            }
        )
    if env.get("torch_cuda"):
        steps += [
            {
                "why": "raise a CUDA error at the kernel that failed, not at a later call",
                "command": "CUDA_LAUNCH_BLOCKING=1 python train.py",
            },
            {
                "why": "find out-of-bounds accesses (torch's caching allocator hides them without the variable)",
                "command": "PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer python train.py",
            },
            {
                "why": "the same under torchrun, one sanitizer per rank",
                "command": "PYTORCH_NO_CUDA_MEMORY_CACHING=1 torchrun --no-python compute-sanitizer python train.py",
            },
        ]
    elif not steps:
        steps.append(
            {
                "why": f"torch {env.get('torch')} is a CPU-only build: there is no CUDA to debug; "
                "for NaN/Inf, name the op where it was born",
                "command": "python -c 'import cublas_guard_ext as cg; help(cg.watch)'",
            }
        )
    return steps


def _newest_capsule() -> str | None:
    """The newest failure capsule in the capsule folder, if any (a recent cuBLAS error's)."""
    try:
        folder = _capsule.directory()
        found = sorted(folder.glob(f"*{_capsule.SUFFIX}"), key=lambda p: p.stat().st_mtime)
    except OSError:
        return None
    return str(found[-1]) if found else None


_MARK = {"OK": "ok  ", "WARN": "WARN", "FAIL": "FAIL", "SKIP": "skip"}


def render(items: list[Check], env: dict, steps: list[dict[str, str]] | None = None) -> str:
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
    lines += render_libraries(env.get("cuda_libraries"))
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
        if check.fix:  # a fix of several lines (the preload lines) stays in its column
            first, *rest = check.fix.splitlines()
            lines.append(f"       {'':<{width}}  fix: {first}")
            lines += [f"       {'':<{width}}       {line}" for line in rest]
    counts = summary(items)
    lines.append("")
    lines.append(
        f"{counts['failed']} failed, {counts['warnings']} warnings, {counts['skipped']} not checkable "
        f"or not applicable here, {counts['ok']} ok"
    )
    steps = steps if steps is not None else next_steps(items, env)
    if steps:
        lines += ["", "Next, ready to paste:"]
        for step in steps:
            lines.append(f"  # {step['why']}")
            lines += [f"  {line}" for line in step["command"].splitlines()]
    return "\n".join(lines)


def main(as_json: bool = False, probe: bool = True, capsule: str | None = None) -> int:
    if capsule is not None:
        try:
            _capsule.load(capsule)  # read first: a file that is no capsule is one line, no report
        except _capsule.CapsuleFileError as err:
            print(f"cublas_guard_ext doctor --capsule: cannot read {err}", file=sys.stderr)
            return 2
    env = facts.environment()
    env.setdefault("cublas", cublas_facts())
    env.setdefault("env", {})
    env["env"].setdefault("CUBLASLT_WORKSPACE_SIZE", os.environ.get("CUBLASLT_WORKSPACE_SIZE"))
    env.setdefault("cuda_libraries", library_facts(env.get("extension", {}).get("path")))
    items = checks(env, probe=probe)
    if capsule is not None:
        try:
            recorded = _capsule.load(capsule)
        except Exception as err:  # a missing or foreign file is one FAIL row, not a traceback
            items.append(Check("capsule", FAIL, f"cannot read {capsule}: {err}"))
        else:
            env["capsule"] = {"path": capsule, "environment": recorded.get("environment")}
            items += capsule_checks(recorded.get("environment") or {}, _capsule.environment())
    steps = next_steps(items, env, capsule if capsule is not None and "capsule" in env else None)
    print(report_json(items, env, steps) if as_json else render(items, env, steps))
    return 1 if any(c.status == "FAIL" for c in items) else 0


if __name__ == "__main__":
    sys.exit(main("--json" in sys.argv))
