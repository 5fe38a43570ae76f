"""Markdown tables of the derived rows (and the one-line target list run.py prints).

Pure formatting: each function takes rows (rows.py) or targets (targets.py) and returns text;
nothing here measures or decides.
"""

from __future__ import annotations

import torch

from .rows import only

MIB = 1 << 20


def size_label(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _us(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 1e5:
        return f"{v / 1e3:,.0f} ms"
    if v >= 1e3:
        return f"{v / 1e3:,.2f} ms"
    return f"{v:,.1f} us"


def targets_table(ts: list[dict]) -> str:
    lines = ["| target | measured | needed | result | detail |", "|---|---|---|---|---|"]
    for t in ts:
        lines.append(
            f"| {t['target']} | {t['measured']} | {t['threshold']} | **{t['status']}** | {t['detail']} |"
        )
    return "\n".join(lines)


def short_table(ts: list[dict]) -> str:
    width = max(len(t["id"]) for t in ts) if ts else 10
    return "\n".join(
        f"{t['status']:<8} {t['id']:<{width}}  {t['measured']:>9} (needs {t['threshold']})  {t['detail']}"
        for t in ts
    )


def scan_table(rows: list[dict], device: torch.device) -> str:
    rows = only(rows)
    ref = "copy GB/s (r+w)" if device.type == "cuda" else "x.sum() GB/s"
    frac = "scan kernel / copy" if device.type == "cuda" else "scan / x.sum()"
    lines = [
        f"| elements | MiB | scan + decision | scan GB/s | scan op alone | scan op GB/s | {ref} | {frac} "
        "| isfinite().all() + bool | scan speed-up | seed check | scan speed-up |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.get("skipped"):
            lines.append(
                f"| {size_label(r['numel'])} | {r['bytes'] / MIB:,.4g} | skipped: {r['skipped']} |" + " |" * 9
            )
            continue
        refv = r["copy_gbs"] if device.type == "cuda" else r["sum_gbs"]
        lines.append(
            f"| {size_label(r['numel'])} | {r['bytes'] / MIB:,.4g} | {_us(r['scan_us'])} | {_f(r['scan_gbs'], ',.1f')} "
            f"| {_us(r['scan_op_us'])} | {_f(r['scan_op_gbs'], ',.1f')} | {_f(refv, ',.1f')} "
            f"| {_f(r['frac'], '.0%')} | {_us(r['isfinite_us'])} | {_f(r['isfinite_x'], '.1f')}x "
            f"| {_us(r['seed_us'])} | {_f(r['seed_x'], '.1f')}x |"
        )
    return "\n".join(lines)


def do_bench_lines(rows: list[dict]) -> str:
    """The triton do_bench cross-check of the large GPU scan sizes, if it ran."""
    lines = []
    for r in rows:
        if r.get("do_bench_scan_gbs"):
            copy = r.get("do_bench_copy_gbs")
            lines.append(
                f"- {size_label(r['numel'])} elements: scan kernel {r['do_bench_scan_gbs']:,.0f} GB/s"
                + (
                    f", copy {copy:,.0f} GB/s (r+w), ratio {r['do_bench_scan_gbs'] / copy:.2f}"
                    if copy
                    else ""
                )
                + f" (batched events: {r['scan_op_gbs']:,.0f} and {_f(r.get('copy_gbs'), ',.0f')} GB/s)"
            )
    if not lines:
        return ""
    return (
        'Cross-check with `triton.testing.do_bench(return_mode="median")` (one call per event pair, '
        "L2 flushed before each):\n" + "\n".join(lines)
    )


def linear_table(rows: list[dict], device: torch.device, only_fwd_tf32_off: bool = False) -> str:
    unit, div = ("TFLOP/s", 1e3) if device.type == "cuda" else ("GFLOP/s", 1.0)
    lines = [
        f"| M | K | N | TF32 | pass | nn.Linear | {unit} | sync | async | off | async adds |",
        "|---:|---:|---:|:-:|:-:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in only(rows):
        if only_fwd_tf32_off and (r["direction"] != "fwd" or r["tf32"]):
            continue
        head = f"| {r['M']} | {r['K']} | {r['N']} | {'on' if r['tf32'] else 'off'} | {r['direction']} "
        if r.get("skipped"):
            lines.append(head + f"| skipped: {r['skipped']} |" + " |" * 5)
            continue
        lines.append(
            head
            + f"| {_us(r['nn_us'])} | {r['nn_gflops'] / div:,.2f} | {r['sync_x']:.3f}x | {r['async_x']:.3f}x "
            f"| {r['off_x']:.3f}x | {r['async_add_us']:+.1f} us |"
        )
    return "\n".join(lines)


def gemm_table(rows: list[dict], device: torch.device) -> str:
    unit, div = ("TFLOP/s", 1e3) if device.type == "cuda" else ("GFLOP/s", 1.0)
    nobias = any("gemm_nobias_x" in r for r in rows)
    head = f"| M | K | N | TF32 | F.linear | {unit} | cg.linear mode=off | {unit} | ratio |"
    sep = "|---:|---:|---:|:-:|---:|---:|---:|---:|---:|"
    if nobias:
        head += f" no bias: F.linear {unit} | cg.linear off {unit} | ratio |"
        sep += "---:|---:|---:|"
    lines = [head, sep]
    for r in rows:
        if r.get("skipped") or "gemm_x" not in r:
            continue
        line = (
            f"| {r['M']} | {r['K']} | {r['N']} | {'on' if r['tf32'] else 'off'} | {_us(r['flinear_us'])} "
            f"| {r['flinear_gflops'] / div:,.2f} | {_us(r['gemm_off_us'])} | {r['gemm_off_gflops'] / div:,.2f} "
            f"| {r['gemm_x']:.3f}x |"
        )
        if nobias:
            line += (
                f" {_f(r.get('flinear_nobias_gflops', 0) / div, ',.2f')} "
                f"| {_f(r.get('gemm_off_nobias_gflops', 0) / div, ',.2f')} | {_f(r.get('gemm_nobias_x'), '.3f')}x |"
            )
        lines.append(line)
    return "\n".join(lines)


def dtype_table(scan: list[dict], linear: list[dict], device: torch.device) -> str:
    """bf16/fp16/fp64 rows: SafeLinear forward against nn.Linear of the same dtype, the scan
    against x.sum() (CPU) or the copy (CUDA) of the same tensor, in bytes."""
    lines = [
        "| dtype | M | K | N | nn.Linear | sync | async | off | off vs F.linear |",
        "|:-:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in linear:
        if r.get("dtype", "float32") == "float32":
            continue
        head = f"| {r['dtype']} | {r['M']} | {r['K']} | {r['N']} "
        if r.get("skipped"):
            lines.append(head + f"| skipped: {r['skipped']} |" + " |" * 4)
            continue
        lines.append(
            head + f"| {_us(r['nn_us'])} | {r['sync_x']:.3f}x | {r['async_x']:.3f}x | {r['off_x']:.3f}x "
            f"| {_f(r.get('gemm_x'), '.3f')}x |"
        )
    ref = "copy GB/s (r+w)" if device.type == "cuda" else "x.sum() GB/s"
    lines += [
        "",
        f"| dtype | elements | MiB | scan + decision GB/s | scan op GB/s | {ref} | fraction |",
        "|:-:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in scan:
        if r.get("dtype", "float32") == "float32":
            continue
        head = f"| {r['dtype']} | {size_label(r['numel'])} | {r['bytes'] / MIB:,.4g} "
        if r.get("skipped"):
            lines.append(head + f"| skipped: {r['skipped']} |" + " |" * 3)
            continue
        refv = r["copy_gbs"] if device.type == "cuda" else r["sum_gbs"]
        lines.append(
            head + f"| {_f(r['scan_gbs'], ',.1f')} | {_f(r['scan_op_gbs'], ',.1f')} | {_f(refv, ',.1f')} "
            f"| {_f(r['frac'], '.0%')} |"
        )
    return "\n".join(lines)


def fixed_table(rows: list[dict], device: torch.device) -> str:
    if not rows:
        return ""
    clocks = ("host", "wall") if device.type == "cuda" else ("host",)
    lines = [
        "| M | K | N | dtype | threads | pass | clock | nn.Linear | off | async | sync |",
        "|---:|---:|---:|:-:|:-:|:-:|:-:|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = (
            f"| {r['M']} | {r['K']} | {r['N']} | {r['dtype']} | {r.get('threads', '-')} | {r['direction']} "
        )
        if r.get("skipped"):
            lines.append(head + f"| | skipped: {r['skipped']} |" + " |" * 3)
            continue
        for clock in clocks:
            if f"{clock}_nn_us" not in r:
                continue
            cells = [f"{r[f'{clock}_nn_us']:.1f} us"]
            for mode in ("off", "async", "sync"):
                cells.append(
                    f"{r[f'{clock}_{mode}_us']:.1f} us ({r[f'{clock}_{mode}_add_us']:+.1f} "
                    f"± {r[f'{clock}_{mode}_noise_us']:.1f})"
                )
            lines.append(head + f"| {clock} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
