"""What watch() costs on a real training step.

One training step (forward, backward, AdamW step) without and with ``cublas_guard_ext.watch(model,
mode="async")`` around the whole step, and for orientation with an empty Python TorchDispatchMode
around it. The model is all-MiniLM-L6-v2 (8 sequences x 56 tokens, MSE on the embeddings) or, with
``--model gpt2``, GPT-2 small built from its config (watch's GPU workload, with ``--bf16``). The
variants run interleaved (A, B, C, A, B, C, ...) and the figures are medians; a ratio compares two
medians of the same interleaved run. On the CPU the table gives wall time and process CPU time (the
CPU time is the steadier figure on a busy machine; with one torch thread it is the step's own work).
The ratio line is printed last.

    python benchmarks/watch_bench.py --threads 1                        # ~1-3 minutes here
    python benchmarks/watch_bench.py --device cuda                      # ~30 s on a GPU
    python benchmarks/watch_bench.py --device cuda --model gpt2 --bf16  # watch's GPU target, <= 1.10x
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parent, HERE):  # the package's checkout, and the harness package
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def main(argv: list[str] | None = None) -> int:
    from harness import training_step

    ap = argparse.ArgumentParser(
        prog="python benchmarks/watch_bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    training_step.add_options(ap)
    ap.add_argument("--no-dispatch-mode", action="store_true", help="skip the empty TorchDispatchMode row")
    ap.add_argument(
        "--model-per-variant",
        action="store_true",
        help="give each variant its own model and optimizer; default: one model, which the "
        "unwatched steps in between change",
    )
    args = ap.parse_args(argv)

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import cublas_guard_ext as cg

    w = training_step.workload(args)
    if isinstance(w, str):
        print(w)
        return 2
    names = ["plain", "watch(async)"] + ([] if args.no_dispatch_mode else ["empty TorchDispatchMode"])
    if args.model_per_variant:
        models = {n: copy.deepcopy(w.model) for n in names}
    else:
        models = dict.fromkeys(names, w.model)
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for name, model in models.items():  # one optimizer per distinct model
        same = next((n for n in optimizers if models[n] is model), None)
        optimizers[name] = optimizers[same] if same else torch.optim.AdamW(model.parameters(), lr=1e-5)

    class Empty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def plain() -> None:
        w.step(models["plain"], optimizers["plain"])

    def watched() -> None:
        with cg.watch(models["watch(async)"], mode="async"):
            w.step(models["watch(async)"], optimizers["watch(async)"])

    def dispatch_mode() -> None:
        with Empty():
            w.step(models["empty TorchDispatchMode"], optimizers["empty TorchDispatchMode"])

    variants = {"plain": plain, "watch(async)": watched, "empty TorchDispatchMode": dispatch_mode}
    variants = {n: variants[n] for n in names}
    t = training_step.interleaved(variants, w.rounds, args.warmup, w.sync)
    # The counts of a step in the steady state (the optimizer's state made, as in the rounds).
    with cg.watch(models["watch(async)"], mode="async") as block:
        w.step(models["watch(async)"], optimizers["watch(async)"])
        ops, scanned = block.stats()
    print(training_step.headline(w, "AdamW", t, w.rounds))
    print(
        f"watch: {ops} ops seen per step, {scanned} scans (one per op output)"
        f"{'; a model per variant' if args.model_per_variant else ''}"
    )
    print("\n".join(training_step.table(t)))
    ratio_wall, ratio_cpu = t.ratio("watch(async)")
    print(
        f"watch(async) vs plain: {ratio_wall:.3f}x wall, {ratio_cpu:.3f}x CPU time (goal: CPU within 1.15x; GPU bf16 within 1.10x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
