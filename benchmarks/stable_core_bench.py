"""What a guarded call costs on each native library: the version-locked _C and the stable core.

Each round starts one child process per library (CUBLAS_GUARD_EXT_NATIVE=locked | core),
alternating, so both see the same machine; a child times, interleaved in one process,
SafeLinear against nn.Linear (16x16, M=1, forward, each mode; forward+backward in sync mode)
and the large layer (1024^3 forward) against F.linear, and prints medians. The parent reports
the medians over rounds: the ratio to nn.Linear, the extra microseconds per call, and the core's
extra cost as a multiple of the locked library's (the target: within 1.5x, issue 49).

    chrt -f 1 python benchmarks/stable_core_bench.py --rounds 5 --threads 1

Run it with the package installed from the wheel (both libraries prebuilt: the locked one's fast
eager entry exists only in a prebuilt _C), from outside the source tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time
import torch
import torch.nn.functional as F
import cublas_guard_ext as cg
from cublas_guard_ext._native.loading import loader

threads, reps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
torch.manual_seed(0)
info = loader.info()

def timed(fn, n):
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n

def pair(guarded, plain, n, repeats=15):
    g, p = [], []
    for _ in range(repeats):  # interleaved
        g.append(timed(guarded, n))
        p.append(timed(plain, n))
    return statistics.median(g), statistics.median(p)

out = {"library": info.library, "path": info.path}
lin = torch.nn.Linear(16, 16)
x = torch.randn(1, 16)
with torch.no_grad():
    for mode in ("off", "async", "sync"):
        safe = cg.SafeLinear.from_linear(lin, mode=mode, name="bench")
        out[f"fwd_{mode}"] = pair(lambda: safe(x), lambda: lin(x), reps)
safe = cg.SafeLinear.from_linear(lin, mode="sync", name="bench")
xg = torch.randn(1, 16, requires_grad=True)
out["fwd_bwd_sync"] = pair(lambda: safe(xg).sum().backward(), lambda: lin(xg).sum().backward(), reps // 4)
big = torch.nn.Linear(1024, 1024)
xb = torch.randn(1024, 1024)
safe_big = cg.SafeLinear.from_linear(big, mode="sync", name="big")
with torch.no_grad():
    out["large_fwd_sync"] = pair(lambda: safe_big(xb), lambda: F.linear(xb, big.weight, big.bias), 2, repeats=7)
print("RESULT " + json.dumps(out))
"""


def run_child(library: str, threads: int, reps: int) -> dict:
    env = dict(os.environ, CUBLAS_GUARD_EXT_NATIVE=library, OMP_NUM_THREADS=str(threads))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(threads), str(reps)], env=env, capture_output=True, text=True
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{library} child failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2000, help="calls per timing of the small layer")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"locked": [], "core": []}
    for _ in range(args.rounds):
        for library in ("locked", "core"):
            runs[library].append(run_child(library, args.threads, args.reps))
    cases = ["fwd_off", "fwd_async", "fwd_sync", "fwd_bwd_sync", "large_fwd_sync"]
    print(f"{args.rounds} rounds, {args.threads} thread(s); medians over rounds")
    print(
        f"{'case':16} {'locked ratio':>12} {'core ratio':>10} {'locked +us':>10} {'core +us':>9} {'core/locked extra':>18}"
    )
    for case in cases:
        row = {}
        for library in ("locked", "core"):
            ratios = [r[case][0] / r[case][1] for r in runs[library]]
            extra = [(r[case][0] - r[case][1]) * 1e6 for r in runs[library]]
            row[library] = (statistics.median(ratios), statistics.median(extra))
        multiple = row["core"][1] / row["locked"][1] if row["locked"][1] > 0 else float("nan")
        print(
            f"{case:16} {row['locked'][0]:12.3f} {row['core'][0]:10.3f} {row['locked'][1]:10.2f} "
            f"{row['core'][1]:9.2f} {multiple:18.2f}"
        )
    print("libraries:", runs["locked"][0]["path"], "|", runs["core"][0]["path"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
