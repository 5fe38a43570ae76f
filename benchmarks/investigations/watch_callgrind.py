"""Instruction counts of MiniLM training steps, plain against watched (watch's CPU target, <= 1.10x).

Counts that do not move with the machine's load: run under callgrind, which dumps
its counters at every call of getppid() (``--dump-before=getppid``); this script
calls os.getppid() between phases, so each dump holds one phase:

    1: import, model load, warm-up (plain and watched steps)
    2, 3: a plain step, a watched step (watch(model, mode="async") around it)
    4, 5: the next round's ...; --steps rounds in all (interleaved, as watch_bench.py runs them)

    valgrind --tool=callgrind --dump-before=getppid --callgrind-out-file=/tmp/cg.%p \\
        .venv/bin/python benchmarks/investigations/watch_callgrind.py --steps 2
    python benchmarks/investigations/watch_callgrind.py --report /tmp/cg.<pid>   # the ratio
    callgrind_annotate /tmp/cg.<pid>.3 | head -60                    # where a watched step goes

Without valgrind it prints the minor page faults of each phase per step
(ru_minflt, the median per step; steadier than time, not exact). As in
benchmarks/watch_bench.py: one model, plain and watched steps interleaved (the
unwatched step in between moves the parameters' and the optimizer state's
versions, so the watched step scans them again).
"""

from __future__ import annotations

import argparse
import glob
import os
import resource
import statistics
import sys
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


def report(prefix: str, steps: int) -> int:
    counts = {}
    for p in glob.glob(prefix + ".*"):
        suffix = p.rsplit(".", 1)[1]
        if suffix.isdigit():
            counts[int(suffix)] = total_instructions(p)
    wanted = range(2, 2 + 2 * steps)
    if any(i not in counts for i in wanted):
        print(f"expected dumps {prefix}.2 to .{1 + 2 * steps}, found {sorted(counts)}")
        return 1
    plain = sum(counts[i] for i in wanted if i % 2 == 0) / steps
    watched = sum(counts[i] for i in wanted if i % 2 == 1) / steps
    print(f"plain   {plain / 1e6:10.1f} M instructions per step")
    print(f"watched {watched / 1e6:10.1f} M instructions per step")
    print(f"ratio   {watched / plain:.4f}x (+{(watched - plain) / 1e6:.1f} M per step)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--report", metavar="PREFIX", help="print the ratio from the dumps PREFIX.2, PREFIX.3")
    args = ap.parse_args(argv)
    if args.report:
        return report(args.report, args.steps)

    import torch

    import cublas_guard_ext as cg
    from cublas_guard_ext.tools import _minilm

    torch.set_num_threads(1)
    model = _minilm.load()
    features = _minilm.batch(model)
    target = torch.randn(8, 384)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def plain() -> None:
        _minilm.step(model, features, optimizer, target)

    def watched() -> None:
        with cg.watch(model, mode="async"):
            _minilm.step(model, features, optimizer, target)

    for _ in range(args.warmup):
        plain()
        watched()
    faults: dict[str, list[int]] = {"plain": [], "watched": []}
    os.getppid()  # dump 1
    for _ in range(args.steps):
        for name, fn in (("plain", plain), ("watched", watched)):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            fn()
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            os.getppid()  # dumps 2 (plain), 3 (watched), 4 (plain), ...
    with cg.watch(model, mode="async") as w:
        _minilm.step(model, features, optimizer, target)
        ops, scanned = w.stats()
    med = {k: statistics.median(v) for k, v in faults.items()}
    print(f"page faults per step (median): plain {med['plain']:,.0f}, watched {med['watched']:,.0f}")
    print(f"  plain {faults['plain']}\n  watched {faults['watched']}")
    print(f"watch: {ops} ops, {scanned} scans")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
