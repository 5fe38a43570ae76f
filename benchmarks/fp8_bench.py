"""FP8 under the guard on the CPU: what clean FP8 training measures, and what the checks cost.

``--ranges``: clean FP8 training (torchao's recipes) of all-MiniLM-L6-v2 and of a small GPT-2 built
from its config (its Conv1D projections as nn.Linear, so that torchao converts them), guarded; the
largest saturated and flushed fractions any operand of any GEMM reached: what the thresholds
(cublas_guard_ext/fp8/formats.py) must stay above.

``--cost``: one FP8 training step (forward, backward, SGD) of the unguarded torchao model and of
the same model under replace_linear (sync mode), interleaved, the ratio of medians.

    .venv/bin/python benchmarks/fp8_bench.py --ranges --cost
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fp8_bench.py --cost --reps 10 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
from torch import nn

import cublas_guard_ext as cge
from cublas_guard_ext.fp8 import checks
from cublas_guard_ext.tools import _minilm

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _convert(model: nn.Module, recipe: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def fits(module: nn.Module, _name: str) -> bool:  # torchao's GEMMs want dims divisible by 16
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    return convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=fits
    )


def _gpt2(seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=4096, n_positions=128))
    for parent in list(model.modules()):  # Conv1D -> nn.Linear (weight transposed), for torchao
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "Conv1D":
                linear = nn.Linear(child.weight.shape[0], child.weight.shape[1])
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    linear.bias.copy_(child.bias)
                setattr(parent, name, linear)
    return model


def _gpt2_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 4096, (4, 64), generator=g)
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return float(loss)


def ranges(steps: int, models: list[str], recipes: list[str]) -> list[str]:
    worst: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])

    def observe(where: Any, sat: float, flush: float) -> None:
        key = (where.recipe, where.gemm, where.operand)
        worst[key][0] = max(worst[key][0], sat)
        worst[key][1] = max(worst[key][1], flush)

    checks.OBSERVERS.append(observe)
    lines = []
    try:
        for label in models:
            for recipe in recipes:
                worst.clear()
                if label == "MiniLM":
                    model = _convert(_minilm.load(seed=0), recipe)
                    cge.replace_linear(model)
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                    features = _minilm.batch(model)
                    target = torch.randn(8, 384, generator=torch.Generator().manual_seed(1))
                    losses = [float(_minilm.step(model, features, opt, target)) for _ in range(steps)]
                else:
                    model = _convert(_gpt2(0), recipe)
                    cge.replace_linear(model, conv1d=False)
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                    losses = [_gpt2_step(model, opt, s) for s in range(steps)]
                sat = max((v[0] for v in worst.values()), default=0.0)
                flush_key, flush = max(((k, v[1]) for k, v in worst.items()), key=lambda kv: kv[1])
                lines.append(
                    f"| {label} | {recipe} | {steps} | {losses[0]:.4f} -> {losses[-1]:.4f} | {sat:.2e} | "
                    f"{flush:.2e} ({flush_key[1]} {flush_key[2]}) |"
                )
                print(lines[-1], flush=True)
    finally:
        checks.OBSERVERS.remove(observe)
    return lines


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024), nn.GELU(), nn.Linear(1024, 1024)
    ).to(torch.bfloat16)


def cost(reps: int, recipe: str) -> str:
    plain = _convert(_mlp(0), recipe)
    guarded = cge.replace_linear(copy.deepcopy(plain))
    x = torch.randn(256, 1024, dtype=torch.bfloat16)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-4) for m in (plain, guarded)}

    def step(model: nn.Module) -> tuple[float, float]:
        """(wall seconds, process CPU seconds): on a shared machine the CPU time of this process
        is the steadier of the two."""
        opt = opts[id(model)]
        start, cpu = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        opt.step()
        return time.perf_counter() - start, time.process_time() - cpu

    for model in (plain, guarded, plain, guarded):  # warm-up
        step(model)
    times: dict[int, list[tuple[float, float]]] = {id(plain): [], id(guarded): []}
    for i in range(reps):  # interleaved, the order alternating
        for model in (plain, guarded) if i % 2 == 0 else (guarded, plain):
            times[id(model)].append(step(model))
    medians = [[statistics.median(t[j] for t in times[id(m)]) for j in (0, 1)] for m in (plain, guarded)]
    (pw, pc), (gw, gc) = medians
    line = (
        f"| MLP 1024-4096-1024-1024, 256 tokens, bf16 | {recipe} | {reps} | {pw * 1e3:.0f} / {pc * 1e3:.0f} ms | "
        f"{gw * 1e3:.0f} / {gc * 1e3:.0f} ms | {gw / pw:.3f} | {gc / pc:.3f} |"
    )
    print(line, flush=True)
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranges", action="store_true")
    parser.add_argument("--cost", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--models", default="MiniLM,GPT-2")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ranges:
        print("| model | recipe | steps | loss | largest saturated fraction | largest flushed fraction |")
        print("|---|---|---:|---|---:|---:|")
        ranges(args.steps, args.models.split(","), args.recipes.split(","))
    if args.cost:
        print(
            "| model | recipe | steps each | unguarded FP8 (wall / CPU) | guarded FP8 (wall / CPU) "
            "| wall ratio | CPU-time ratio |"
        )
        print("|---|---|---:|---:|---:|---:|---:|")
        for recipe in args.recipes.split(","):
            cost(args.reps, recipe)


if __name__ == "__main__":
    main()
