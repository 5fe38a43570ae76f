"""Instructions per op of a tiny op (``y.mul(x)``, 16 float32 elements), plain against watched.

Counts that do not move with the machine's load (issue 50, point 1). Under callgrind, which
dumps its counters at every call of getppid() (``--dump-before=getppid``); this script calls
os.getppid() between phases, so each dump holds one phase:

    1: import, warm-up
    2: --ops plain calls of the op
    3: --ops calls inside one ``cg.watch()`` block (report="birth", no model)
    4: --ops calls inside one ``cg.watch(model)`` block (report="consequence")

    valgrind --tool=callgrind --dump-before=getppid --dump-instr=no \\
        --callgrind-out-file=/tmp/cgop.%p .venv/bin/python benchmarks/investigations/watch_op_callgrind.py \\
        --repeats 0
    python benchmarks/investigations/watch_op_callgrind.py --report /tmp/cgop.<pid>
    callgrind_annotate --inclusive=yes /tmp/cgop.<pid>.3 | head -80   # where a watched op goes

Without valgrind it prints wall-clock µs per op (medians of interleaved repeats; noisy).
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def total_instructions(path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith("summary:") or line.startswith("totals:"):
                return int(line.split()[1])
    raise ValueError(f"{path}: no summary line")


def report(prefix: str, ops: int) -> int:
    counts = {}
    for p in glob.glob(prefix + ".*"):
        suffix = p.rsplit(".", 1)[1]
        if suffix.isdigit():
            counts[int(suffix)] = total_instructions(p)
    if any(i not in counts for i in (2, 3, 4)):
        print(f"expected dumps {prefix}.2 to .4, found {sorted(counts)}")
        return 1
    plain = counts[2] / ops
    print(f"plain                 {plain:8.0f} instructions per op")
    for name, i in (("watch() (birth)", 3), ("watch(model)", 4)):
        w = counts[i] / ops
        print(f"{name:21s} {w:8.0f} instructions per op  ({w / plain:.2f}x, +{w - plain:.0f})")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds after the dumps (0 under valgrind)")
    ap.add_argument("--report", metavar="PREFIX", help="print the per-op counts from the dumps PREFIX.2-.4")
    args = ap.parse_args(argv)
    if args.report:
        return report(args.report, args.ops)

    import torch

    import cublas_guard_ext as cg

    torch.set_num_threads(1)
    torch.manual_seed(0)
    y, x = torch.randn(16), torch.randn(16)
    model = torch.nn.Linear(4, 4)
    n = args.ops

    def plain() -> None:
        for _ in range(n):
            y.mul(x)

    def watched() -> None:
        with cg.watch(mode="async"):
            for _ in range(n):
                y.mul(x)

    def watched_model() -> None:
        with cg.watch(model, mode="async"):
            for _ in range(n):
                y.mul(x)

    for _ in range(2):
        plain()
        watched()
        watched_model()
    os.getppid()  # dump 1
    plain()
    os.getppid()  # dump 2
    watched()
    os.getppid()  # dump 3
    watched_model()
    os.getppid()  # dump 4
    times: dict[str, list[float]] = {"plain": [], "watch()": [], "watch(model)": []}
    for _ in range(args.repeats):
        for name, fn in (("plain", plain), ("watch()", watched), ("watch(model)", watched_model)):
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / n * 1e6)
    for k, v in times.items():
        if v:
            print(f"{k:14s} {statistics.median(v):6.2f} us per op (median of {len(v)}, interleaved)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
