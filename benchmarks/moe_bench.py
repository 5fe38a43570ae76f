"""What guarding a mixture of experts costs on a training step (target <= 1.10x on the CPU).

A tiny Mixtral built from a config (random weights, offline; by default 2 layers, hidden 256,
8 experts of 512, top-2, 4 sequences x 128 tokens), one training step (forward, cross-entropy,
backward, AdamW) in three variants, each training its own copy of the model:

* ``grouped_mm``: unguarded, transformers' default experts implementation on the CPU;
* ``experts``: the experts through the guarded grouped GEMM
  (``set_experts_implementation("cublas_guard")``), the Linears plain;
* ``replace_linear``: the whole model guarded (``cublas_guard_ext.replace_linear``: SafeLinear
  everywhere and the guarded experts), the target's "guarded step".

The variants run interleaved (A, B, C, A, B, C, ...); the figures are medians over rounds and
the ratios compare two medians of one run.

    python benchmarks/moe_bench.py --threads 1            # ~1-3 minutes on a CPU
    python benchmarks/moe_bench.py --threads 1 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))


def build(args: argparse.Namespace):
    import torch
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=max(512, args.tokens),
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    return model.train()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/moe_bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--min-run-time", type=float, default=0.5, help="seconds per measurement")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)

    import torch

    import cublas_guard_ext as cg
    from cublas_guard_ext.tools import bench

    torch.set_num_threads(args.threads)
    base = build(args)
    models = {name: copy.deepcopy(base) for name in ("grouped_mm", "experts", "replace_linear")}
    models["grouped_mm"].set_experts_implementation("grouped_mm")
    models["experts"].set_experts_implementation("cublas_guard")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the routers are left unguarded: said once, not here
        cg.replace_linear(models["replace_linear"])
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, m in models.items()}
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=gen)

    def step_of(name: str):
        model, opt = models[name], opts[name]

        def step() -> object:
            opt.zero_grad(set_to_none=True)
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            return loss

        return step

    device = torch.device("cpu")
    times = bench.interleaved(
        {name: step_of(name) for name in models}, device, rounds=args.rounds, min_run_time=args.min_run_time
    )
    med = {name: statistics.median(v) for name, v in times.items()}
    result = {
        "threads": args.threads,
        "shape": {
            k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "experts", "batch", "tokens")
        },
        "rounds": args.rounds,
        "median_ms": {name: v * 1e3 for name, v in med.items()},
        "ratio_experts": med["experts"] / med["grouped_mm"],
        "ratio_replace_linear": med["replace_linear"] / med["grouped_mm"],
        "torch": torch.__version__,
    }
    print(
        f"tiny Mixtral training step, {args.threads} thread(s), medians of {args.rounds} interleaved rounds"
    )
    for name, ms in result["median_ms"].items():
        print(f"  {name:15s} {ms:9.2f} ms")
    print(f"  guarded experts / grouped_mm: {result['ratio_experts']:.3f}x")
    print(f"  replace_linear  / grouped_mm: {result['ratio_replace_linear']:.3f}x (target <= 1.10x)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
