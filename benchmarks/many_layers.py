"""Per-call cost with many live layers, the forward right after a parameter update.

The clean-parameter cache once pruned all its entries on every update past
4,096 entries, so a forward after an update cost 6-20x more with 3,000-8,000
layers alive. This measures a forward through one small layer right after its
parameters changed (an in-place update bumps their versions, as an optimizer
step does), with N other guarded layers alive and known clean: the cost per
call must not grow with N.

    python benchmarks/many_layers.py [--layers 100 3000 8000] [--json out.json]

Prints one row per N: medians over rounds (interleaved with nn.Linear doing the
same update and forward) in microseconds per update+forward, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext.tools import bench


def measure(n_layers: int, rounds: int, min_run_time: float) -> dict:
    torch.manual_seed(0)
    device = torch.device("cpu")
    layers = [cg.SafeLinear(16, 16, name=f"l{i}") for i in range(n_layers)]
    x = torch.randn(4, 16)
    with torch.no_grad():
        for layer in layers:  # every layer's parameters scanned once: N*2 live cache entries
            layer(x)
    ref = nn.Linear(16, 16)
    probe = layers[n_layers // 2]

    def updated_forward(layer: nn.Module) -> object:
        with torch.no_grad():
            layer.weight.add_(0.0)  # a tracked in-place update: the next forward re-scans
            layer.bias.add_(0.0)
            return layer(x)

    fns = {"nn.Linear": lambda: updated_forward(ref), "SafeLinear": lambda: updated_forward(probe)}
    times = bench.interleaved(fns, device, rounds=rounds, min_run_time=min_run_time)
    med = {name: statistics.median(v) for name, v in times.items()}
    entries, live, _ = torch.ops.cublas_guard_testing.clean_cache_stats.default()
    return {
        "layers": n_layers,
        "nn_linear_us": med["nn.Linear"] * 1e6,
        "safelinear_us": med["SafeLinear"] * 1e6,
        "ratio": med["SafeLinear"] / med["nn.Linear"],
        "cache_entries": entries,
        "cache_live": live,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[100, 3000, 8000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = [measure(n, args.rounds, args.min_run_time) for n in args.layers]
    print(f"{'layers':>7} {'nn.Linear us':>13} {'SafeLinear us':>14} {'ratio':>6} {'cache entries':>14}")
    for r in rows:
        print(
            f"{r['layers']:>7} {r['nn_linear_us']:>13.1f} {r['safelinear_us']:>14.1f} "
            f"{r['ratio']:>6.2f} {r['cache_entries']:>14}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
