"""The targets (PASS / MISS / NOT RUN) each preset is held to, from the derived rows.

One place for every threshold the project holds itself to (the scan's bandwidth and speed-up,
SafeLinear against nn.Linear / F.linear, the fixed cost per call), so that the table
in RESULTS.md and the PASS/MISS lines run.py prints cannot disagree.
"""

from __future__ import annotations

import torch

from .rows import only
from .tables import size_label


def _target(
    tid: str, text: str, value: float | None, threshold: float, better: str, fmt: str, detail: str = ""
) -> dict:
    if value is None:
        status = "NOT RUN"
    elif better == ">=":
        status = "PASS" if value >= threshold else "MISS"
    else:
        status = "PASS" if value <= threshold else "MISS"
    return {
        "id": tid,
        "target": text,
        "value": None if value is None else round(value, 4),
        "threshold": f"{better} {format(threshold, fmt)}",
        "measured": "-" if value is None else format(value, fmt),
        "status": status,
        "detail": detail,
    }


def _find_linear(
    rows: list[dict],
    m: int,
    k: int,
    n: int,
    direction: str = "fwd",
    tf32: bool = False,
    dtype: str = "float32",
) -> dict | None:
    for r in rows:
        if (r["M"], r["K"], r["N"], r["direction"], bool(r["tf32"]), r.get("dtype", "float32")) == (
            m,
            k,
            n,
            direction,
            tf32,
            dtype,
        ) and not r.get("skipped"):
            return r
    return None


def _per_size(rows: list[dict], key: str, lo: int, hi: int | None = None) -> tuple[float | None, str]:
    vals = [
        (r["numel"], r.get(key))
        for r in rows
        if not r.get("skipped") and r["numel"] >= lo and (hi is None or r["numel"] <= hi) and r.get(key)
    ]
    if not vals:
        return None, ""
    detail = ", ".join(f"{size_label(n)}: {v:.2f}" for n, v in vals)
    return min(v for _, v in vals), f"worst of {detail}"


def targets(scan: list[dict], linear: list[dict], device: torch.device) -> list[dict]:
    out = []
    scan_bf16 = only(scan, "bfloat16")
    scan = only(scan)
    if device.type == "cpu":
        v, d = _per_size(scan_bf16, "frac", 1 << 24)
        out.append(
            _target(
                "cpu-bf16-scan-bw",
                "bf16 scan (with its decision) reads >= 80% of bf16 x.sum()'s "
                "read bandwidth in bytes, 16M elements and more",
                v,
                0.80,
                ">=",
                ".2f",
                d,
            )
        )
        r = _find_linear(linear, 1024, 1024, 1024, dtype="bfloat16")
        d = (
            f"sync {r['sync_x']:.3f}x, async {r['async_x']:.3f}x, off {r['off_x']:.3f}x nn.Linear bf16"
            if r
            else ""
        )
        out.append(
            _target(
                "cpu-bf16-linear-1024",
                "bf16 SafeLinear forward (sync) <= 1.05x nn.Linear bf16 at M=K=N=1024",
                r.get("sync_x") if r else None,
                1.05,
                "<=",
                ".3f",
                d,
            )
        )
        v, d = _per_size(scan, "frac", 1 << 24)
        out.append(
            _target(
                "cpu-scan-bw",
                "scan (with its decision) reads at >= 80% of x.sum()'s read bandwidth, 16M elements and more",
                v,
                0.80,
                ">=",
                ".2f",
                d,
            )
        )
        v, d = _per_size(scan, "isfinite_x", 1 << 24)
        out.append(
            _target(
                "cpu-scan-vs-isfinite",
                "scan >= 10x faster than bool(torch.isfinite(x).all()), 16M elements and more",
                v,
                10.0,
                ">=",
                ".1f",
                d,
            )
        )
        r = _find_linear(linear, 1024, 1024, 1024)
        v = r.get("sync_vs_flinear_x") if r else None
        d = ""
        if r:
            d = (
                f"sync {r['sync_vs_flinear_x']:.3f}x, async {r['async_vs_flinear_x']:.3f}x, "
                f"off {r['off_vs_flinear_x']:.3f}x F.linear; vs nn.Linear: sync {r['sync_x']:.3f}x"
            )
        out.append(
            _target(
                "cpu-linear-1024",
                "SafeLinear forward (default mode sync) <= 1.03x F.linear at M=K=N=1024",
                v,
                1.03,
                "<=",
                ".3f",
                d,
            )
        )
        return out
    v, d = _per_size(scan_bf16, "frac", 1 << 27)
    out.append(
        _target(
            "gpu-bf16-scan-bw",
            "bf16 scan kernel's read bandwidth >= 90% of the copy bandwidth (read+write), 256 MiB and more",
            v,
            0.90,
            ">=",
            ".2f",
            d,
        )
    )
    for dtype, tag in (("bfloat16", "bf16"), ("float16", "fp16")):
        r = _find_linear(linear, 8192, 4096, 4096, dtype=dtype)
        out.append(
            _target(
                f"gpu-{tag}-linear-8192-async",
                f"{tag} SafeLinear forward mode=async <= 1.03x nn.Linear {tag} at M=8192, K=N=4096",
                r.get("async_x") if r else None,
                1.03,
                "<=",
                ".3f",
            )
        )
    big = 1 << 26  # 256 MiB of float32
    v, d = _per_size(scan, "frac", big)
    out.append(
        _target(
            "gpu-scan-bw",
            "scan kernel's read bandwidth >= 90% of the device-to-device copy "
            "bandwidth (read+write), inputs of 256 MiB and more",
            v,
            0.90,
            ">=",
            ".2f",
            d,
        )
    )
    v, d = _per_size(scan, "isfinite_x", big)
    out.append(
        _target(
            "gpu-scan-vs-isfinite",
            "scan with its decision >= 1.4x faster than isfinite().all() with its decision, 256 MiB and more",
            v,
            1.4,
            ">=",
            ".2f",
            d,
        )
    )
    v, d = _per_size(scan, "seed_x", big)
    out.append(
        _target(
            "gpu-scan-vs-seed",
            "scan with its decision >= 2.7x faster than the two-assert check, 256 MiB and more",
            v,
            2.7,
            ">=",
            ".2f",
            d,
        )
    )
    small_i, d_i = _per_size(scan, "isfinite_x", 0, 1 << 20)
    large_i, _ = _per_size(scan, "isfinite_x", big)
    out.append(
        _target(
            "gpu-scan-small",
            "further ahead at small sizes (<= 1M elements): worst small-size "
            "speed-up over isfinite().all() >= worst large-size one",
            None if small_i is None or large_i is None else small_i / large_i,
            1.0,
            ">=",
            ".2f",
            f"small {d_i}",
        )
    )
    r = _find_linear(linear, 8192, 4096, 4096)
    for mode, limit in (("async", 1.01), ("sync", 1.05), ("off", 1.02)):
        out.append(
            _target(
                f"gpu-linear-8192-{mode}",
                f"SafeLinear forward mode={mode} <= {limit}x nn.Linear at M=8192, K=N=4096, TF32 off",
                r.get(f"{mode}_x") if r else None,
                limit,
                "<=",
                ".3f",
            )
        )
    r = _find_linear(linear, 32, 1024, 1024)
    out.append(
        _target(
            "gpu-linear-32-async-us",
            "mode=async adds <= 5 us per call at M=32, K=N=1024 (forward, TF32 off)",
            r.get("async_add_us") if r else None,
            5.0,
            "<=",
            ".2f",
            (f"nn.Linear {r['nn_us']:.1f} us, async {r['async_us']:.1f} us" if r else ""),
        )
    )
    r = _find_linear(linear, 8192, 4096, 4096)
    if r and "gemm_x" in r:
        d = (
            f"checked cublasSgemm {r['gemm_off_gflops'] / 1e3:.1f} vs F.linear {r['flinear_gflops'] / 1e3:.1f} "
            "TFLOP/s with bias"
        )
        if "gemm_nobias_x" in r:
            d += (
                f"; without bias {r['gemm_off_nobias_gflops'] / 1e3:.1f} vs "
                f"{r['flinear_nobias_gflops'] / 1e3:.1f} TFLOP/s ({r['gemm_nobias_x']:.3f}x)"
            )
        out.append(
            _target(
                "gpu-gemm-alone",
                "(diagnostic) GEMM alone: mode=off cg.linear <= 1.02x F.linear at M=8192, K=N=4096, TF32 off",
                r["gemm_x"],
                1.02,
                "<=",
                ".3f",
                d,
            )
        )
    return out


def fixed_targets(rows: list[dict], device: torch.device) -> list[dict]:
    out = []
    if device.type == "cpu":
        for direction, what in (("fwd", "forward under no_grad"), ("fwd+bwd", "forward+backward")):
            worst: dict[str, tuple[float, str]] = {}
            for r in rows:
                if (
                    r.get("skipped")
                    or (r["M"], r["K"], r["N"]) != (1, 16, 16)
                    or "host_nn_us" not in r
                    or r["direction"] != direction
                ):
                    continue
                for mode in ("off", "async", "sync"):
                    add = r[f"host_{mode}_add_us"]
                    where = f"{r['dtype']}, {r.get('threads', '-')} thread(s)"
                    if mode not in worst or add > worst[mode][0]:
                        worst[mode] = (add, where)
            tag = "fwd" if direction == "fwd" else "train"
            for mode, limit in (("off", 2.0), ("async", 2.0), ("sync", 4.0)):
                v = worst.get(mode)
                out.append(
                    _target(
                        f"cpu-fixed-{tag}-{mode}",
                        f"SafeLinear mode={mode} adds <= {limit:g} us per "
                        f"call over nn.Linear at M=1, K=N=16, {what} (worst of fp32/bf16, 1/2 threads)",
                        v[0] if v else None,
                        limit,
                        "<=",
                        ".2f",
                        f"worst: {v[1]}" if v else "",
                    )
                )
        return out
    r = next(
        (
            r
            for r in rows
            if (r["M"], r["K"], r["N"], r["dtype"], r["direction"]) == (32, 1024, 1024, "float32", "fwd")
            and not r.get("skipped")
            and "host_nn_us" in r
        ),
        None,
    )
    for mode, clock, limit in (
        ("off", "host", 2.0),
        ("async", "host", 4.0),
        ("sync", "host", 12.0),
        ("async", "wall", 5.0),
    ):
        out.append(
            _target(
                f"gpu-fixed-{mode}-{clock}",
                f"mode={mode} adds <= {limit:g} us of {clock} time per "
                "call over nn.Linear at M=32, K=N=1024 (fp32 forward, no_grad)",
                r.get(f"{clock}_{mode}_add_us") if r else None,
                limit,
                "<=",
                ".2f",
                (
                    f"nn.Linear {r[f'{clock}_nn_us']:.1f} us, {mode} {r[f'{clock}_{mode}_us']:.1f} us"
                    if r and f"{clock}_{mode}_us" in r
                    else ""
                ),
            )
        )
    return out
