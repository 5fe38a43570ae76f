"""Tables, targets (PASS/MISS), the overhead plot and the RESULTS.md section."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
from pathlib import Path

import torch

from .suite import linear_flops

GIB = 1 << 30
MIB = 1 << 20


# ---------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> str:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    return "unknown"


def _sched_policy() -> str:
    """The process's scheduling policy: SCHED_FIFO/RR when run under `chrt` on a shared machine."""
    try:
        policy = os.sched_getscheduler(0)
    except (AttributeError, OSError):
        return "unknown"
    names = {getattr(os, n): n for n in ("SCHED_OTHER", "SCHED_FIFO", "SCHED_RR", "SCHED_BATCH", "SCHED_IDLE")
             if hasattr(os, n)}
    name = names.get(policy, str(policy))
    if name in ("SCHED_FIFO", "SCHED_RR"):
        name += f" priority {os.sched_getparam(0).sched_priority}"
    return name


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(device: torch.device) -> dict:
    import cublas_guard_ext._native.loader as loader

    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory": _mem_total(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": str(device),
        "loadavg_start": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "scheduling": _sched_policy(),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }
    info = loader.info()
    env["extension"] = f"{info.kind} ({'with' if info.has_cuda_kernels else 'without'} CUDA kernels)"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["gpu_cc"] = f"{props.major}.{props.minor}"
        env["gpu_memory"] = f"{props.total_memory / GIB:.0f} GiB"
        env["gpu_l2"] = f"{getattr(props, 'L2_cache_size', 0) / MIB:.0f} MiB"
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            env["nvidia_smi"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else ""
        except (OSError, subprocess.SubprocessError):
            env["nvidia_smi"] = ""
        try:
            import triton

            env["triton"] = triton.__version__
        except Exception:  # noqa: BLE001 (optional)
            env["triton"] = None
    return env


# ---------------------------------------------------------------------------
# Derived rows
# ---------------------------------------------------------------------------
def _med(rec: dict, name: str) -> float | None:
    return rec.get("median_s", {}).get(name)


def _dtype_of(params: dict) -> str:
    return params.get("dtype", "float32")


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def only(rows: list[dict], dtype: str = "float32") -> list[dict]:
    """The rows of one dtype (float32: the suite's original rows)."""
    return [r for r in rows if r.get("dtype", "float32") == dtype]


def scan_rows(records: list[dict], device: torch.device) -> list[dict]:
    rows = []
    for rec in records:
        if rec["kind"] != "scan":
            continue
        n = rec["params"]["numel"]
        dtype = _dtype_of(rec["params"])
        size = _itemsize(dtype)
        row: dict = {"numel": n, "bytes": size * n, "skipped": rec.get("skipped"), "dtype": dtype}
        if "skipped" in rec:
            rows.append(row)
            continue
        scan, scan_op = _med(rec, "scan"), _med(rec, "scan_op")
        row["scan_us"] = scan * 1e6
        row["scan_op_us"] = scan_op * 1e6
        row["scan_gbs"] = size * n / scan / 1e9
        row["scan_op_gbs"] = size * n / scan_op / 1e9
        total = _med(rec, "sum")
        row["sum_gbs"] = size * n / total / 1e9 if total else None
        copy = _med(rec, "copy")
        row["copy_gbs"] = 2 * size * n / copy / 1e9 if copy else None
        if device.type == "cuda":
            # The scan kernel's read bandwidth against the copy's (bytes read + written).
            row["ref_name"] = "copy"
            row["frac"] = row["scan_op_gbs"] / row["copy_gbs"] if row["copy_gbs"] else None
        else:
            # The scan with its decision against x.sum()'s read bandwidth.
            row["ref_name"] = "sum"
            row["frac"] = row["scan_gbs"] / row["sum_gbs"] if row["sum_gbs"] else None
        for base in ("isfinite", "seed"):
            t = _med(rec, base)
            row[f"{base}_us"] = t * 1e6 if t else None
            row[f"{base}_x"] = t / scan if t else None
        row["buffers"] = rec.get("buffers")
        row["rounds"] = rec.get("rounds")
        db = rec.get("do_bench_ms")
        if db and "scan_op" in db:
            row["do_bench_scan_gbs"] = 4 * n / (db["scan_op"] / 1e3) / 1e9
            row["do_bench_copy_gbs"] = 8 * n / (db["copy"] / 1e3) / 1e9 if db.get("copy") else None
        rows.append(row)
    return rows


def linear_rows(records: list[dict]) -> list[dict]:
    rows = []
    for rec in records:
        if rec["kind"] != "linear":
            continue
        p = rec["params"]
        row: dict = dict(p)
        row["dtype"] = _dtype_of(p)
        if "skipped" in rec:
            row["skipped"] = rec["skipped"]
            rows.append(row)
            continue
        base = _med(rec, "nn.Linear")
        flops = linear_flops(p["M"], p["K"], p["N"], p["direction"])
        row["nn_us"] = base * 1e6
        row["nn_gflops"] = flops / base / 1e9
        for mode in ("sync", "async", "off"):
            t = _med(rec, mode)
            row[f"{mode}_us"] = t * 1e6
            row[f"{mode}_x"] = t / base
            row[f"{mode}_add_us"] = (t - base) * 1e6
        fl = _med(rec, "F.linear")
        if fl:
            row["flinear_us"] = fl * 1e6
            row["flinear_gflops"] = flops / fl / 1e9
            for mode in ("sync", "async", "off"):
                row[f"{mode}_vs_flinear_x"] = _med(rec, mode) / fl
            g = _med(rec, "gemm_off")
            row["gemm_off_us"] = g * 1e6
            row["gemm_off_gflops"] = flops / g / 1e9
            row["gemm_x"] = g / fl
        fln, gn = _med(rec, "F.linear_nobias"), _med(rec, "gemm_off_nobias")
        if fln and gn:
            row["gemm_nobias_x"] = gn / fln
            row["flinear_nobias_gflops"] = flops / fln / 1e9
            row["gemm_off_nobias_gflops"] = flops / gn / 1e9
        rows.append(row)
    return rows


def _paired(base: list[float], other: list[float]) -> tuple[float, float]:
    """Median and noise (half the interquartile range) of the per-round differences, in us."""
    diffs = sorted((o - b) * 1e6 for b, o in zip(base, other))
    if len(diffs) < 2:
        return (diffs[0] if diffs else 0.0), 0.0
    q = statistics.quantiles(diffs, n=4, method="inclusive")
    return statistics.median(diffs), (q[2] - q[0]) / 2


def fixed_rows(records: list[dict]) -> list[dict]:
    """The fixed cost per call (issue 12): each mode's time and its difference to nn.Linear."""
    rows = []
    for rec in records:
        if rec["kind"] != "fixed":
            continue
        row: dict = dict(rec["params"])
        row["dtype"] = _dtype_of(rec["params"])
        if "skipped" in rec:
            row["skipped"] = rec["skipped"]
            rows.append(row)
            continue
        for clock, key in (("host", "times_s"), ("wall", "wall_times_s")):
            times = rec.get(key)
            if not times:
                continue
            base = times["nn.Linear"]
            row[f"{clock}_nn_us"] = statistics.median(base) * 1e6
            for mode in ("off", "async", "sync"):
                row[f"{clock}_{mode}_us"] = statistics.median(times[mode]) * 1e6
                add, noise = _paired(base, times[mode])
                row[f"{clock}_{mode}_add_us"] = add
                row[f"{clock}_{mode}_noise_us"] = noise
        rows.append(row)
    return rows


def fixed_table(rows: list[dict], device: torch.device) -> str:
    if not rows:
        return ""
    clocks = ("host", "wall") if device.type == "cuda" else ("host",)
    lines = ["| M | K | N | dtype | threads | pass | clock | nn.Linear | off | async | sync |",
             "|---:|---:|---:|:-:|:-:|:-:|:-:|---:|---:|---:|---:|"]
    for r in rows:
        head = (f"| {r['M']} | {r['K']} | {r['N']} | {r['dtype']} | {r.get('threads', '-')} "
                f"| {r['direction']} ")
        if r.get("skipped"):
            lines.append(head + f"| | skipped: {r['skipped']} |" + " |" * 3)
            continue
        for clock in clocks:
            if f"{clock}_nn_us" not in r:
                continue
            cells = [f"{r[f'{clock}_nn_us']:.1f} us"]
            for mode in ("off", "async", "sync"):
                cells.append(f"{r[f'{clock}_{mode}_us']:.1f} us ({r[f'{clock}_{mode}_add_us']:+.1f} "
                             f"± {r[f'{clock}_{mode}_noise_us']:.1f})")
            lines.append(head + f"| {clock} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


FIXED_NOTE = (
    "Fixed cost per call: `layer(x)` of nn.Linear and of a SafeLinear sharing its parameters, in each "
    "mode, interleaved (a batch of back-to-back calls per function and round, the same count for all); "
    "forward under `torch.no_grad()`, or forward+backward as `torch.autograd.grad(layer(x), (x, weight, "
    "bias), g)`. Each cell: median us per call (median difference to nn.Linear in the same round ± half "
    "the interquartile range of those differences). host = until the last call returned; wall = until "
    "the device finished too (`torch.cuda.synchronize`; CUDA only)."
)


def fixed_targets(rows: list[dict], device: torch.device) -> list[dict]:
    out = []
    if device.type == "cpu":
        for direction, what in (("fwd", "forward under no_grad"), ("fwd+bwd", "forward+backward")):
            worst: dict[str, tuple[float, str]] = {}
            for r in rows:
                if (r.get("skipped") or (r["M"], r["K"], r["N"]) != (1, 16, 16) or "host_nn_us" not in r
                        or r["direction"] != direction):
                    continue
                for mode in ("off", "async", "sync"):
                    add = r[f"host_{mode}_add_us"]
                    where = f"{r['dtype']}, {r.get('threads', '-')} thread(s)"
                    if mode not in worst or add > worst[mode][0]:
                        worst[mode] = (add, where)
            tag = "fwd" if direction == "fwd" else "train"
            for mode, limit in (("off", 2.0), ("async", 2.0), ("sync", 4.0)):
                v = worst.get(mode)
                out.append(_target(f"cpu-fixed-{tag}-{mode}", f"SafeLinear mode={mode} adds <= {limit:g} us per "
                                   f"call over nn.Linear at M=1, K=N=16, {what} (worst of fp32/bf16, 1/2 threads)",
                                   v[0] if v else None, limit, "<=", ".2f", f"worst: {v[1]}" if v else ""))
        return out
    r = next((r for r in rows if (r["M"], r["K"], r["N"], r["dtype"], r["direction"]) == (32, 1024, 1024,
              "float32", "fwd") and not r.get("skipped") and "host_nn_us" in r), None)
    for clock, limit in (("host", 3.0), ("wall", 5.0)):
        out.append(_target(f"gpu-fixed-async-{clock}", f"mode=async adds <= {limit:g} us of {clock} time per "
                           "call over nn.Linear at M=32, K=N=1024 (fp32 forward, no_grad)",
                           r.get(f"{clock}_async_add_us") if r else None, limit, "<=", ".2f",
                           (f"nn.Linear {r[f'{clock}_nn_us']:.1f} us, async {r[f'{clock}_async_us']:.1f} us"
                            if r and f"{clock}_nn_us" in r else "")))
    return out


# ---------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------
def _target(tid: str, text: str, value: float | None, threshold: float, better: str, fmt: str,
            detail: str = "") -> dict:
    if value is None:
        status = "NOT RUN"
    elif better == ">=":
        status = "PASS" if value >= threshold else "MISS"
    else:
        status = "PASS" if value <= threshold else "MISS"
    return {"id": tid, "target": text, "value": None if value is None else round(value, 4),
            "threshold": f"{better} {format(threshold, fmt)}",
            "measured": "-" if value is None else format(value, fmt), "status": status, "detail": detail}


def _find_linear(rows: list[dict], m: int, k: int, n: int, direction: str = "fwd", tf32: bool = False,
                 dtype: str = "float32") -> dict | None:
    for r in rows:
        if ((r["M"], r["K"], r["N"], r["direction"], bool(r["tf32"]), r.get("dtype", "float32"))
                == (m, k, n, direction, tf32, dtype) and not r.get("skipped")):
            return r
    return None


def _per_size(rows: list[dict], key: str, lo: int, hi: int | None = None) -> tuple[float | None, str]:
    vals = [(r["numel"], r.get(key)) for r in rows
            if not r.get("skipped") and r["numel"] >= lo and (hi is None or r["numel"] <= hi) and r.get(key)]
    if not vals:
        return None, ""
    detail = ", ".join(f"{_size(n)}: {v:.2f}" for n, v in vals)
    return min(v for _, v in vals), f"worst of {detail}"


def targets(scan: list[dict], linear: list[dict], device: torch.device) -> list[dict]:
    out = []
    scan_bf16 = only(scan, "bfloat16")
    scan = only(scan)
    if device.type == "cpu":
        v, d = _per_size(scan_bf16, "frac", 1 << 24)
        out.append(_target("cpu-bf16-scan-bw", "bf16 scan (with its decision) reads >= 80% of bf16 x.sum()'s "
                           "read bandwidth in bytes, 16M elements and more", v, 0.80, ">=", ".2f", d))
        r = _find_linear(linear, 1024, 1024, 1024, dtype="bfloat16")
        d = (f"sync {r['sync_x']:.3f}x, async {r['async_x']:.3f}x, off {r['off_x']:.3f}x nn.Linear bf16"
             if r else "")
        out.append(_target("cpu-bf16-linear-1024", "bf16 SafeLinear forward (sync) <= 1.05x nn.Linear bf16 at "
                           "M=K=N=1024", r.get("sync_x") if r else None, 1.05, "<=", ".3f", d))
        v, d = _per_size(scan, "frac", 1 << 24)
        out.append(_target("cpu-scan-bw", "scan (with its decision) reads at >= 80% of x.sum()'s read "
                           "bandwidth, 16M elements and more", v, 0.80, ">=", ".2f", d))
        v, d = _per_size(scan, "isfinite_x", 1 << 24)
        out.append(_target("cpu-scan-vs-isfinite", "scan >= 10x faster than bool(torch.isfinite(x).all()), "
                           "16M elements and more", v, 10.0, ">=", ".1f", d))
        r = _find_linear(linear, 1024, 1024, 1024)
        v = r.get("sync_vs_flinear_x") if r else None
        d = ""
        if r:
            d = (f"sync {r['sync_vs_flinear_x']:.3f}x, async {r['async_vs_flinear_x']:.3f}x, "
                 f"off {r['off_vs_flinear_x']:.3f}x F.linear; vs nn.Linear: sync {r['sync_x']:.3f}x")
        out.append(_target("cpu-linear-1024", "SafeLinear forward (default mode sync) <= 1.03x F.linear at "
                           "M=K=N=1024", v, 1.03, "<=", ".3f", d))
        return out
    v, d = _per_size(scan_bf16, "frac", 1 << 27)
    out.append(_target("gpu-bf16-scan-bw", "bf16 scan kernel's read bandwidth >= 90% of the copy bandwidth "
                       "(read+write), 256 MiB and more", v, 0.90, ">=", ".2f", d))
    r = _find_linear(linear, 8192, 4096, 4096, dtype="bfloat16")
    out.append(_target("gpu-bf16-linear-8192-async", "bf16 SafeLinear forward mode=async <= 1.03x nn.Linear "
                       "bf16 at M=8192, K=N=4096", r.get("async_x") if r else None, 1.03, "<=", ".3f"))
    big = 1 << 26  # 256 MiB of float32
    v, d = _per_size(scan, "frac", big)
    out.append(_target("gpu-scan-bw", "scan kernel's read bandwidth >= 90% of the device-to-device copy "
                       "bandwidth (read+write), inputs of 256 MiB and more", v, 0.90, ">=", ".2f", d))
    v, d = _per_size(scan, "isfinite_x", big)
    out.append(_target("gpu-scan-vs-isfinite", "scan with its decision >= 1.4x faster than "
                       "isfinite().all() with its decision, 256 MiB and more", v, 1.4, ">=", ".2f", d))
    v, d = _per_size(scan, "seed_x", big)
    out.append(_target("gpu-scan-vs-seed", "scan with its decision >= 2.7x faster than the seed's check, "
                       "256 MiB and more", v, 2.7, ">=", ".2f", d))
    small_i, d_i = _per_size(scan, "isfinite_x", 0, 1 << 20)
    large_i, _ = _per_size(scan, "isfinite_x", big)
    out.append(_target("gpu-scan-small", "further ahead at small sizes (<= 1M elements): worst small-size "
                       "speed-up over isfinite().all() >= worst large-size one",
                       None if small_i is None or large_i is None else small_i / large_i, 1.0, ">=", ".2f",
                       f"small {d_i}"))
    r = _find_linear(linear, 8192, 4096, 4096)
    for mode, limit in (("async", 1.02), ("sync", 1.05), ("off", 1.02)):
        out.append(_target(f"gpu-linear-8192-{mode}", f"SafeLinear forward mode={mode} <= {limit}x nn.Linear "
                           "at M=8192, K=N=4096, TF32 off", r.get(f"{mode}_x") if r else None, limit, "<=", ".3f"))
    r = _find_linear(linear, 32, 1024, 1024)
    out.append(_target("gpu-linear-32-async-us", "mode=async adds <= 5 us per call at M=32, K=N=1024 "
                       "(forward, TF32 off)", r.get("async_add_us") if r else None, 5.0, "<=", ".2f",
                       (f"nn.Linear {r['nn_us']:.1f} us, async {r['async_us']:.1f} us" if r else "")))
    r = _find_linear(linear, 8192, 4096, 4096)
    if r and "gemm_x" in r:
        d = (f"checked cublasSgemm {r['gemm_off_gflops'] / 1e3:.1f} vs F.linear {r['flinear_gflops'] / 1e3:.1f} "
             "TFLOP/s with bias")
        if "gemm_nobias_x" in r:
            d += (f"; without bias {r['gemm_off_nobias_gflops'] / 1e3:.1f} vs "
                  f"{r['flinear_nobias_gflops'] / 1e3:.1f} TFLOP/s ({r['gemm_nobias_x']:.3f}x)")
        out.append(_target("gpu-gemm-alone", "(diagnostic) GEMM alone: mode=off cg.linear <= 1.02x F.linear "
                           "at M=8192, K=N=4096, TF32 off", r["gemm_x"], 1.02, "<=", ".3f", d))
    return out


# ---------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------
def _size(n: int) -> str:
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
        lines.append(f"| {t['target']} | {t['measured']} | {t['threshold']} | **{t['status']}** | {t['detail']} |")
    return "\n".join(lines)


def dtype_table(scan: list[dict], linear: list[dict], device: torch.device) -> str:
    """bf16/fp16/fp64 rows: SafeLinear forward against nn.Linear of the same dtype, the scan
    against x.sum() (CPU) or the copy (CUDA) of the same tensor, in bytes."""
    lines = ["| dtype | M | K | N | nn.Linear | sync | async | off | off vs F.linear |",
             "|:-:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in linear:
        if r.get("dtype", "float32") == "float32":
            continue
        head = f"| {r['dtype']} | {r['M']} | {r['K']} | {r['N']} "
        if r.get("skipped"):
            lines.append(head + f"| skipped: {r['skipped']} |" + " |" * 4)
            continue
        lines.append(head + f"| {_us(r['nn_us'])} | {r['sync_x']:.3f}x | {r['async_x']:.3f}x | {r['off_x']:.3f}x "
                     f"| {_f(r.get('gemm_x'), '.3f')}x |")
    ref = "copy GB/s (r+w)" if device.type == "cuda" else "x.sum() GB/s"
    lines += ["", f"| dtype | elements | MiB | scan + decision GB/s | scan op GB/s | {ref} | fraction |",
              "|:-:|---:|---:|---:|---:|---:|---:|"]
    for r in scan:
        if r.get("dtype", "float32") == "float32":
            continue
        head = f"| {r['dtype']} | {_size(r['numel'])} | {r['bytes'] / MIB:,.4g} "
        if r.get("skipped"):
            lines.append(head + f"| skipped: {r['skipped']} |" + " |" * 3)
            continue
        refv = r["copy_gbs"] if device.type == "cuda" else r["sum_gbs"]
        lines.append(head + f"| {_f(r['scan_gbs'], ',.1f')} | {_f(r['scan_op_gbs'], ',.1f')} | {_f(refv, ',.1f')} "
                     f"| {_f(r['frac'], '.0%')} |")
    return "\n".join(lines)


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
            lines.append(f"| {_size(r['numel'])} | {r['bytes'] / MIB:,.4g} | skipped: {r['skipped']} |" + " |" * 9)
            continue
        refv = r["copy_gbs"] if device.type == "cuda" else r["sum_gbs"]
        lines.append(
            f"| {_size(r['numel'])} | {r['bytes'] / MIB:,.4g} | {_us(r['scan_us'])} | {_f(r['scan_gbs'], ',.1f')} "
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
            lines.append(f"- {_size(r['numel'])} elements: scan kernel {r['do_bench_scan_gbs']:,.0f} GB/s"
                         + (f", copy {copy:,.0f} GB/s (r+w), ratio {r['do_bench_scan_gbs'] / copy:.2f}" if copy else "")
                         + f" (batched events: {r['scan_op_gbs']:,.0f} and {_f(r.get('copy_gbs'), ',.0f')} GB/s)")
    if not lines:
        return ""
    return ("Cross-check with `triton.testing.do_bench(return_mode=\"median\")` (one call per event pair, "
            "L2 flushed before each):\n" + "\n".join(lines))


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
            head + f"| {_us(r['nn_us'])} | {r['nn_gflops'] / div:,.2f} | {r['sync_x']:.3f}x | {r['async_x']:.3f}x "
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
        line = (f"| {r['M']} | {r['K']} | {r['N']} | {'on' if r['tf32'] else 'off'} | {_us(r['flinear_us'])} "
                f"| {r['flinear_gflops'] / div:,.2f} | {_us(r['gemm_off_us'])} | {r['gemm_off_gflops'] / div:,.2f} "
                f"| {r['gemm_x']:.3f}x |")
        if nobias:
            line += (f" {_f(r.get('flinear_nobias_gflops', 0) / div, ',.2f')} "
                     f"| {_f(r.get('gemm_off_nobias_gflops', 0) / div, ',.2f')} | {_f(r.get('gemm_nobias_x'), '.3f')}x |")
        lines.append(line)
    return "\n".join(lines)


def env_lines(env: dict, command: str, preset_note: str, wall_s: float) -> str:
    lines = [
        f"- date: {env['date_utc']}",
        f"- command: `{command}` ({wall_s:.0f} s)",
        f"- machine: {env['cpu']}, {env['cpu_cores']} cores, {env['memory']} RAM; "
        f"{env['torch_threads']} torch threads; scheduling {env.get('scheduling', '?')}; load average "
        f"(1/5/15 min) at start {env['loadavg_start']}, at end {env.get('loadavg_end', '?')}",
    ]
    if "gpu" in env:
        lines.append(f"- GPU: {env['gpu']} (cc {env['gpu_cc']}, {env['gpu_memory']}, L2 {env['gpu_l2']}); "
                     f"nvidia-smi driver/max SM clock/max mem clock: {env.get('nvidia_smi') or '?'}")
    lines.append(f"- Python {env['python']}, torch {env['torch']}"
                 + (f" (CUDA {env['torch_cuda']})" if env.get("torch_cuda") else "")
                 + (f", triton {env['triton']}" if env.get("triton") else "")
                 + f"; extension {env['extension']}; git {env['git_commit']}{' + local changes' if env['git_dirty'] else ''}")
    lines.append(f"- cases: {preset_note}")
    return "\n".join(lines)


METHOD = """\
How it is measured: every group of functions compared with each other runs interleaved in one process
(A, B, C, then A, B, C again, ...: {rounds} rounds), each round timing one function with
{timer}; the figures are medians of the rounds and every ratio compares medians of one group. Forward
runs under `torch.no_grad()`; forward+backward is `torch.autograd.grad(layer(x), (x, weight, bias), g)`
(three GEMMs). SafeLinear shares nn.Linear's parameters (`SafeLinear.from_linear`). "decision" = the
host knows the answer: `cg.scan(x).all_finite`, `bool(torch.isfinite(x).all())`, and the seed's
`assert not torch.isnan(x).any()` + `assert not torch.isinf(x).any()`. "scan op alone" is
`torch.ops.cublas_guard.scan(x)` without reading the result.{extra}"""


def method_text(device: torch.device, rounds: int) -> str:
    if device.type == "cuda":
        timer = "CUDA events around a batch of back-to-back calls (per-call time = batch time / calls)"
        extra = (" Scan inputs rotate over buffers of at least 3x the L2 cache together, so repeated "
                 "calls read from HBM. Bandwidth: the scan counts the bytes it reads; the device-to-device "
                 "copy `dst.copy_(x)` of the same size, measured in the same group, counts bytes read + written.")
    else:
        timer = "`torch.utils.benchmark.Timer.blocked_autorange` with all torch threads"
        extra = (" Bandwidth: bytes read per second; the reference is `x.sum()` of the same tensor, measured "
                 "in the same group.")
    return METHOD.format(rounds=rounds, timer=timer, extra=extra)


def fixed_parts(fixed: list[dict] | None, device: torch.device, heading: str) -> list[str]:
    """The fixed-cost table with its heading and note (nothing when there are no such rows)."""
    if not fixed:
        return []
    return [f"{heading} Fixed cost per call", FIXED_NOTE, fixed_table(fixed, device)]


def summary_markdown(preset_name: str, env: dict, command: str, note: str, wall_s: float, device: torch.device,
                     rounds: int, ts: list[dict], scan: list[dict], linear: list[dict], plot_name: str,
                     fixed: list[dict] | None = None) -> str:
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
            "## The GEMM alone: `cg.linear(x, w, b, mode=\"off\")` (checks + checked GEMM) against `F.linear`",
            gemm_table(only(linear), device),
            "## bfloat16, float16, float64",
            dtype_table(scan, linear, device),
        ]
    parts += fixed_parts(fixed, device, "##")
    return "\n\n".join(p for p in parts if p) + "\n"


def results_section(preset_name: str, env: dict, command: str, note: str, wall_s: float, device: torch.device,
                    rounds: int, ts: list[dict], scan: list[dict], linear: list[dict], rel_dir: str,
                    plot_name: str, fixed: list[dict] | None = None) -> str:
    title = {"cpu": "CPU", "gpu": "GPU", "cpu-fixed": "CPU, fixed cost per call",
             "gpu-fixed": "GPU, fixed cost per call"}.get(preset_name, preset_name)
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


# ---------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------
def plot(path: Path, scan: list[dict], linear: list[dict], ts: list[dict], device: torch.device,
         env: dict | None = None) -> Path:
    """overhead.png with matplotlib (Agg); overhead.svg by hand if matplotlib is missing."""
    scan = [r for r in only(scan) if not r.get("skipped")]
    linear = [r for r in only(linear) if not r.get("skipped")]
    ref = "copy (r+w)" if device.type == "cuda" else "x.sum()"
    frac_target = 0.90 if device.type == "cuda" else 0.80
    speed_target = 1.4 if device.type == "cuda" else 10.0
    panels = [
        {
            "title": f"scan bandwidth / {ref} bandwidth",
            "xlabel": "elements (float32)", "ylabel": "fraction", "logy": False,
            "series": [("scan" + (" kernel" if device.type == "cuda" else " + decision"),
                        [(r["numel"], r["frac"]) for r in scan if r.get("frac")])],
            "hline": (frac_target, f"target {frac_target:.0%}"),
            "ylim0": True,
        },
        {
            "title": "scan speed-up over the naive checks (with decisions)",
            "xlabel": "elements (float32)", "ylabel": "time ratio (x)", "logy": True,
            "series": [("isfinite().all()", [(r["numel"], r["isfinite_x"]) for r in scan if r.get("isfinite_x")]),
                       ("seed check", [(r["numel"], r["seed_x"]) for r in scan if r.get("seed_x")])],
            "hline": (speed_target, f"target vs isfinite: {speed_target:g}x (large sizes)"),
            "hline2": (2.7, "target vs seed: 2.7x (large sizes)") if device.type == "cuda" else None,
        },
    ]
    series = []
    for mode in ("sync", "async", "off"):
        for direction in ("fwd", "fwd+bwd"):
            for tf32 in (False, True):
                pts = sorted((linear_flops(r["M"], r["K"], r["N"], "fwd"), r[f"{mode}_x"]) for r in linear
                             if r["direction"] == direction and bool(r["tf32"]) == tf32)
                if pts:
                    style = {"color": {"sync": "tab:red", "async": "tab:blue", "off": "tab:green"}[mode],
                             "ls": "-" if direction == "fwd" else "--", "marker": "^" if tf32 else "o"}
                    series.append((f"{mode} {direction}" + (" tf32" if tf32 else ""), pts, style))
    panels.append({
        "title": "SafeLinear / nn.Linear time", "xlabel": "GEMM size 2*M*K*N (FLOP)", "ylabel": "time ratio (x)",
        "logy": False, "series": series, "hline": (1.0, "nn.Linear"),
    })
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        svg = path.with_suffix(".svg")
        svg.write_text(_svg(panels))
        return svg
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    for ax, pnl in zip(axes, panels):
        for label, pts, *style in pnl["series"]:
            if pts:
                xs, ys = zip(*pts)
                kw = {"marker": "o", **(style[0] if style else {})}
                ax.plot(xs, ys, ms=3.5, lw=1.2, label=label, **kw)
        y, lab = pnl["hline"]
        ax.axhline(y, color="k", ls=":", lw=0.9, label=lab)
        if pnl.get("hline2"):
            y2, lab2 = pnl["hline2"]
            ax.axhline(y2, color="gray", ls=":", lw=0.9, label=lab2)
        ax.set_xscale("log", base=2)
        if pnl["logy"]:
            ax.set_yscale("log")
        if pnl.get("ylim0"):
            top = max([1.1] + [y * 1.1 for _, pts, *_ in pnl["series"] for _, y in pts])
            ax.set_ylim(0, top)
        ax.set_title(pnl["title"], fontsize=10)
        ax.set_xlabel(pnl["xlabel"])
        ax.set_ylabel(pnl["ylabel"])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    env = env or {}
    where = env.get("gpu") or env.get("cpu") or device.type.upper()
    fig.suptitle(f"cublas_guard_ext overhead: {where}, torch {env.get('torch', torch.__version__)}, "
                 f"{env.get('date_utc', '')}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _svg(panels: list[dict]) -> str:
    """A plain SVG line chart per panel (log2 x), for machines without matplotlib."""
    import math

    w, h, pad = 420, 300, 48
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
              "#bcbd22", "#17becf", "#000000", "#aaaa00"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * len(panels)}" height="{h}" font-size="9" '
           'font-family="sans-serif">']
    for i, pnl in enumerate(panels):
        ox = i * w
        pts = [p for _, s, *_ in pnl["series"] for p in s if p[1] and p[1] > 0]
        if not pts:
            continue
        ty = (lambda v: math.log10(v)) if pnl["logy"] else (lambda v: v)
        xs = [math.log2(x) for x, _ in pts]
        ys = [ty(y) for _, y in pts] + [ty(pnl["hline"][0])]
        x0, x1 = min(xs), max(xs) + 1e-9
        y0 = min(ys + ([] if pnl["logy"] else [0.0]))
        y1 = max(ys) + 0.05 * (max(ys) - y0) + 1e-9

        def px(x: float) -> float:
            return ox + pad + (math.log2(x) - x0) / (x1 - x0) * (w - 2 * pad)

        def py(y: float) -> float:
            return h - pad - (ty(y) - y0) / (y1 - y0) * (h - 2 * pad)

        out.append(f'<rect x="{ox + pad}" y="{pad}" width="{w - 2 * pad}" height="{h - 2 * pad}" fill="none" stroke="#888"/>')
        out.append(f'<text x="{ox + w / 2}" y="16" text-anchor="middle" font-size="11">{pnl["title"]}</text>')
        out.append(f'<text x="{ox + w / 2}" y="{h - 8}" text-anchor="middle">{pnl["xlabel"]} (log2)</text>')
        hv = pnl["hline"][0]
        out.append(f'<line x1="{ox + pad}" x2="{ox + w - pad}" y1="{py(hv):.1f}" y2="{py(hv):.1f}" stroke="#000" stroke-dasharray="4"/>')
        out.append(f'<text x="{ox + pad + 2}" y="{py(hv) - 3:.1f}">{pnl["hline"][1]}</text>')
        for k, (label, s, *_) in enumerate(pnl["series"]):
            s = [p for p in s if p[1] and p[1] > 0]
            if not s:
                continue
            c = colors[k % len(colors)]
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s)
            out.append(f'<polyline points="{path}" fill="none" stroke="{c}"/>')
            out.append(f'<text x="{ox + w - pad - 4}" y="{pad + 12 + 11 * k}" text-anchor="end" fill="{c}">{label}</text>')
        for frac in (0.0, 0.5, 1.0):
            yv = y0 + frac * (y1 - y0)
            label = f"{10 ** yv:.3g}" if pnl["logy"] else f"{yv:.3g}"
            out.append(f'<text x="{ox + pad - 3}" y="{h - pad - frac * (h - 2 * pad):.1f}" text-anchor="end">{label}</text>')
    out.append("</svg>")
    return "\n".join(out)


def write_json(path: Path, payload: dict) -> None:
    def default(o):
        if isinstance(o, torch.device):
            return str(o)
        raise TypeError(type(o))

    path.write_text(json.dumps(payload, indent=1, default=default))


def short_table(ts: list[dict]) -> str:
    width = max(len(t["id"]) for t in ts) if ts else 10
    return "\n".join(f"{t['status']:<8} {t['id']:<{width}}  {t['measured']:>9} (needs {t['threshold']})  {t['detail']}"
                     for t in ts)

