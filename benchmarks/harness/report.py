"""The documents of a run: summary.md, the RESULTS.md section (rewritten in place between its
preset's markers) and results.json.

Composes the tables (tables.py) with the environment lines and the method text; a run of one
kind of case (`run.py --only fixed`) gets its own section, so it never overwrites the preset's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .rows import only
from .tables import (
    do_bench_lines,
    dtype_table,
    fixed_table,
    gemm_table,
    linear_table,
    scan_table,
    targets_table,
)


def env_lines(env: dict, command: str, preset_note: str, wall_s: float) -> str:
    lines = [
        f"- date: {env['date_utc']}",
        f"- command: `{command}` ({wall_s:.0f} s)",
        f"- machine: {env['cpu']}, {env['cpu_cores']} cores, {env['memory']} RAM; "
        f"{env['torch_threads']} torch threads; scheduling {env.get('scheduling', '?')}; load average "
        f"(1/5/15 min) at start {env['loadavg_start']}, at end {env.get('loadavg_end', '?')}",
    ]
    if "gpu" in env:
        lines.append(
            f"- GPU: {env['gpu']} (cc {env['gpu_cc']}, {env['gpu_memory']}, L2 {env['gpu_l2']}); "
            f"nvidia-smi driver/max SM clock/max mem clock: {env.get('nvidia_smi') or '?'}"
            + (f"; cuBLAS {env['cublas']}" if env.get("cublas") else "")
        )
    lines.append(
        f"- Python {env['python']}, torch {env['torch']}"
        + (f" (CUDA {env['torch_cuda']})" if env.get("torch_cuda") else "")
        + (f", triton {env['triton']}" if env.get("triton") else "")
        + f"; extension {env['extension']}; git {env['git_commit']}{' + local changes' if env['git_dirty'] else ''}"
    )
    lines.append(f"- cases: {preset_note}")
    return "\n".join(lines)


METHOD = """\
How it is measured: every group of functions compared with each other runs interleaved in one process
(A, B, C, then A, B, C again, ...: {rounds} rounds), each round timing one function with
{timer}; the figures are medians of the rounds and every ratio compares medians of one group. Forward
runs under `torch.no_grad()`; forward+backward is `torch.autograd.grad(layer(x), (x, weight, bias), g)`
(three GEMMs). SafeLinear shares nn.Linear's parameters (`SafeLinear.from_linear`). "decision" = the
host knows the answer: `cg.scan(x).all_finite`, `bool(torch.isfinite(x).all())`, and the two-assert check
`assert not torch.isnan(x).any()` + `assert not torch.isinf(x).any()`. "scan op alone" is
`torch.ops.cublas_guard.scan(x)` without reading the result.{extra}"""


def method_text(device: torch.device, rounds: int) -> str:
    if device.type == "cuda":
        timer = "CUDA events around a batch of back-to-back calls (per-call time = batch time / calls)"
        extra = (
            " Scan inputs rotate over buffers of at least 3x the L2 cache together, so repeated "
            "calls read from HBM. Bandwidth: the scan counts the bytes it reads; the device-to-device "
            "copy `dst.copy_(x)` of the same size, measured in the same group, counts bytes read + written."
        )
    else:
        timer = "`torch.utils.benchmark.Timer.blocked_autorange` with all torch threads"
        extra = (
            " Bandwidth: bytes read per second; the reference is `x.sum()` of the same tensor, measured "
            "in the same group."
        )
    return METHOD.format(rounds=rounds, timer=timer, extra=extra)


FIXED_NOTE = (
    "Fixed cost per call: `layer(x)` of nn.Linear and of a SafeLinear sharing its parameters, in each "
    "mode, interleaved (a batch of back-to-back calls per function and round, the same count for all); "
    "forward under `torch.no_grad()`, or forward+backward as `torch.autograd.grad(layer(x), (x, weight, "
    "bias), g)`. Each cell: median us per call (median difference to nn.Linear in the same round ± half "
    "the interquartile range of those differences). host = until the last call returned; wall = until "
    "the device finished too (`torch.cuda.synchronize`; CUDA only)."
)


def fixed_parts(fixed: list[dict] | None, device: torch.device, heading: str) -> list[str]:
    """The fixed-cost table with its heading and note (nothing when there are no such rows)."""
    if not fixed:
        return []
    return [f"{heading} Fixed cost per call", FIXED_NOTE, fixed_table(fixed, device)]


def summary_markdown(
    preset_name: str,
    env: dict,
    command: str,
    note: str,
    wall_s: float,
    device: torch.device,
    rounds: int,
    ts: list[dict],
    scan: list[dict],
    linear: list[dict],
    plot_name: str,
    fixed: list[dict] | None = None,
) -> str:
    main = bool(scan or linear)  # False for a run of the fixed-cost cases alone
    parts = [
        f"# Benchmarks, preset `{preset_name}` on {device.type.upper()}",
        env_lines(env, command, note, wall_s),
        method_text(device, rounds) if main else "",
        "## Targets",
        targets_table(ts),
        f"![overhead vs size]({plot_name})" if main else "",
    ]
    if main:
        parts += [
            "## The scan against the naive checks",
            scan_table(scan, device),
            do_bench_lines(scan),
            "## SafeLinear against nn.Linear (time ratio; `async adds` = async - nn.Linear per call)",
            linear_table(linear, device),
            '## The GEMM alone: `cg.linear(x, w, b, mode="off")` (checks + checked GEMM) against `F.linear`',
            gemm_table(only(linear), device),
            "## bfloat16, float16, float64",
            dtype_table(scan, linear, device),
        ]
    parts += fixed_parts(fixed, device, "##")
    return "\n\n".join(p for p in parts if p) + "\n"


def results_section(
    preset_name: str,
    env: dict,
    command: str,
    note: str,
    wall_s: float,
    device: torch.device,
    rounds: int,
    ts: list[dict],
    scan: list[dict],
    linear: list[dict],
    rel_dir: str,
    plot_name: str,
    fixed: list[dict] | None = None,
) -> str:
    title = {
        "cpu": "CPU",
        "gpu": "GPU",
        "cpu-fixed": "CPU, fixed cost per call",
        "gpu-fixed": "GPU, fixed cost per call",
    }.get(preset_name, preset_name)
    main = bool(scan or linear)  # False for a run of the fixed-cost cases alone
    parts = [
        f"## {title} (preset `{preset_name}`)",
        env_lines(env, command, note, wall_s),
        "### Targets",
        targets_table(ts),
    ]
    if main:
        parts += [
            f"![overhead vs size]({rel_dir}/{plot_name})",
            "### The scan against the naive checks",
            scan_table(scan, device),
            do_bench_lines(scan),
            "### SafeLinear forward against nn.Linear, TF32 off (all cases: "
            f"[{rel_dir}/summary.md]({rel_dir}/summary.md))",
            linear_table(linear, device, only_fwd_tf32_off=True),
            "### The GEMM alone",
            gemm_table([r for r in only(linear) if not r.get("tf32")], device),
            "### bfloat16, float16, float64 (forward, TF32 off)",
            dtype_table(scan, linear, device),
        ]
    parts += fixed_parts(fixed, device, "###")
    return "\n\n".join(p for p in parts if p)


def update_results_md(path: Path, preset_name: str, section: str) -> None:
    begin, end = f"<!-- BEGIN preset:{preset_name} -->", f"<!-- END preset:{preset_name} -->"
    block = f"{begin}\n{section}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _m: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def write_json(path: Path, payload: dict) -> None:
    def default(o):
        if isinstance(o, torch.device):
            return str(o)
        raise TypeError(type(o))

    path.write_text(json.dumps(payload, indent=1, default=default))
