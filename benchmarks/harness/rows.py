"""Rows derived from the suite's records: per-case medians turned into us, GB/s, FLOP/s and ratios.

Every ratio compares two medians of the same interleaved group (suite.py measures the functions
of a group round-robin in one process), never figures of separate runs. The fixed-cost rows
also keep the per-round differences to nn.Linear (their median and noise), which are steadier
than the difference of two medians on a busy machine.
"""

from __future__ import annotations

import statistics

import torch

from .suite import linear_flops


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
    """The fixed cost per call: each mode's time and its difference to nn.Linear."""
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
