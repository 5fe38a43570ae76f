"""``python -m cublas_guard_ext doctor``: the first thing to run after a cuBLAS error.

Reports the environment (torch, CUDA driver/runtime, cuBLAS version and the
libraries actually loaded, GPUs and their memory, TF32, the relevant
environment variables, how the extension was built) and evaluates the
checklist item by item: OK / WARN / FAIL with the reason and the fix, SKIP
for what this machine cannot check (e.g. no GPU). Exit status 1 on any FAIL.
"""

from __future__ import annotations

import sys

from . import diagnostics

_MARK = {"OK": "ok  ", "WARN": "WARN", "FAIL": "FAIL", "SKIP": "skip"}


def render(items: list[diagnostics.Check], env: dict) -> str:
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
            f"  CUDA driver {diagnostics._cuda_version_text(ext.get('driver_version'))}, runtime "
            f"{diagnostics._cuda_version_text(ext.get('cudart_runtime_version'))}, cuBLAS "
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
    lines.append(f"  environment: {set_vars or 'none of ' + ', '.join(diagnostics.ENV_VARS)}")
    lines.append("")
    width = max(len(c.name) for c in items)
    for check in items:
        lines.append(f"[{_MARK[check.status]}] {check.name:<{width}}  {check.reason}")
        if check.fix:
            lines.append(f"       {'':<{width}}  fix: {check.fix}")
    counts = diagnostics.summary(items)
    lines.append("")
    lines.append(
        f"{counts['failed']} failed, {counts['warnings']} warnings, {counts['skipped']} not checkable "
        f"or not applicable here, {counts['ok']} ok"
    )
    return "\n".join(lines)


def main(as_json: bool = False, probe: bool = True) -> int:
    env = diagnostics.environment()
    items = diagnostics.checks(env, probe=probe)
    print(diagnostics.as_json(items, env) if as_json else render(items, env))
    return 1 if any(c.status == "FAIL" for c in items) else 0


if __name__ == "__main__":
    sys.exit(main("--json" in sys.argv))
