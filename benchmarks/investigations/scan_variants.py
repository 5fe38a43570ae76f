"""A/B the CPU scan's hot-loop variants side by side with x.sum() and the real scan.

    python benchmarks/investigations/scan_variants.py [--threads 1,2] [--sizes 4M,16M,64M,256M] [--rounds 7]

Builds scan_variants.cpp with the extension's CPU flags (-O3 -fopenmp, baseline x86-64) via
torch.utils.cpp_extension.load (about a minute), then times every variant interleaved with
x.sum() at each size, and prints GB/s and the fraction of x.sum()'s read bandwidth.
Used for benchmarks/investigations/NOTES.md (the variants are described in scan_variants.cpp).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

import cublas_guard_ext as cg  # noqa: E402
from cublas_guard_ext.tools import bench  # noqa: E402


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--sizes", default="4M,16M,64M,256M")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-run-time", type=float, default=0.1)
    args = ap.parse_args()
    mod = cpp_extension.load(
        name="cublas_guard_scan_variants",
        sources=[str(HERE / "scan_variants.cpp")],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    variants = [
        "v0_single_acc",
        "v1_vec4_sse2",
        "v1_vec4_avx2",
        "v1_noblock",
        "v2_max",
        "v1_prefetch",
        "read_or",
    ]
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for n in [parse_size(s) for s in args.sizes.split(",")]:
            x = torch.randn(n)
            fns = {"x.sum()": lambda: x.sum(), "cg.scan (built)": lambda: cg.scan(x).all_finite}
            for v in variants:
                fns[v] = lambda f=getattr(mod, v): f(x)  # noqa: B008 (binds this variant now)
            times = bench.interleaved(
                fns, torch.device("cpu"), rounds=args.rounds, min_run_time=args.min_run_time
            )
            med = {k: statistics.median(v) for k, v in times.items()}
            ref = 4 * n / med["x.sum()"] / 1e9
            print(f"threads={threads} n={n:,} ({4 * n / 2**20:.0f} MiB): x.sum() {ref:.1f} GB/s")
            for k, t in med.items():
                gbs = 4 * n / t / 1e9
                print(f"    {k:18s} {t * 1e3:9.3f} ms  {gbs:6.1f} GB/s  {gbs / ref:6.0%} of x.sum()")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
