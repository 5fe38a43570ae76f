"""Per-call cost breakdown of SafeLinear's eager path, CPU.

Every piece is timed interleaved with the others in one process: each round
times N calls of each piece in turn; the figure is the median over rounds of
the per-call time. Usage (the machine's load matters: say it next to figures):

    python benchmarks/investigations/percall_breakdown.py [--rounds 15] [--calls 2000] [--threads 1] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext.guarded_linear import _transforms, modes, ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kn", type=int, default=16)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--grad", action="store_true", help="forward+backward instead of no_grad forward")
    ap.add_argument(
        "--device", default="cpu", help="cpu or cuda (host time per call; wall in its own column)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    lin = nn.Linear(args.kn, args.kn, dtype=dtype, device=dev)
    safe = {
        m: cg.SafeLinear(args.kn, args.kn, dtype=dtype, mode=m, name="l", device=dev)
        for m in ("off", "async", "sync")
    }
    for s in safe.values():
        s.load_state_dict(lin.state_dict())
    x = torch.randn(args.m, args.kn, dtype=dtype, device=dev)
    w, b = lin.weight.detach(), lin.bias.detach()
    op = torch.ops.cublas_guard.linear.default
    raw = op._op
    fast = getattr(ops, "_fast_linear", None)
    fns = {
        "nn.Linear": lambda: lin(x),
        "F.linear": lambda: F.linear(x, w, b),
        "SafeLinear off": lambda: safe["off"](x),
        "SafeLinear async": lambda: safe["async"](x),
        "SafeLinear sync": lambda: safe["sync"](x),
    }
    if args.grad:
        xg = x.clone().requires_grad_()
        fns = {
            "nn.Linear": lambda: lin(xg).sum().backward(),
            "F.linear": lambda: F.linear(xg, lin.weight, lin.bias).sum().backward(),
            "SafeLinear off": lambda: safe["off"](xg).sum().backward(),
            "SafeLinear async": lambda: safe["async"](xg).sum().backward(),
            "SafeLinear sync": lambda: safe["sync"](xg).sum().backward(),
        }
    else:
        fns.update(
            {
                "ops.linear(mode=off)": lambda: ops.linear(x, w, b, layer="l", mode="off"),
                "ops.linear(mode=None)": lambda: ops.linear(x, w, b, layer="l"),
                "torch.ops ... .default off": lambda: op(x, w, b, "l", 0, False),
                "torch.ops ... .default async": lambda: op(x, w, b, "l", 2, False),
                "torch.ops ... .default sync": lambda: op(x, w, b, "l", 1, False),
                "OpOverload._op off (no Python __call__)": lambda: raw(x, w, b, "l", 0, False),
                "modes.current()": modes.current,
                "torch.compiler.is_compiling()": torch.compiler.is_compiling,
                "_transforms.active()": _transforms.active,
                "os.environ.get": lambda: os.environ.get("CUBLAS_GUARD_MODE"),
                "SafeLinear.guard_label": lambda: safe["off"].guard_label,
                "empty Python call": lambda: None,
            }
        )
        if fast is not None:
            fns["_fast_linear off"] = lambda: fast(x, w, b, "l", 0, False)
            fns["_fast_linear async"] = lambda: fast(x, w, b, "l", 2, False)
            fns["_fast_linear sync"] = lambda: fast(x, w, b, "l", 1, False)
    ctx = torch.enable_grad() if args.grad else torch.no_grad()
    with ctx:
        for fn in fns.values():
            for _ in range(50):
                fn()
        per = {k: [] for k in fns}
        wall = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                n = args.calls
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    fn()
                per[k].append((time.perf_counter_ns() - t0) / n / 1000)
                if cuda:
                    torch.cuda.synchronize()
                wall[k].append((time.perf_counter_ns() - t0) / n / 1000)
        if not args.grad:
            # The native op below autograd (what a no_grad call costs without the autograd kernel).
            below = []
            with torch._C._AutoDispatchBelowADInplaceOrView():
                for _ in range(args.rounds):
                    t0 = time.perf_counter_ns()
                    for _ in range(args.calls):
                        op(x, w, b, "l", 0, False)
                    below.append((time.perf_counter_ns() - t0) / args.calls / 1000)
            per["torch.ops ... .default off, below autograd"] = below
            wall["torch.ops ... .default off, below autograd"] = below
    base = statistics.median(per["nn.Linear"])
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}, "
        f"threads {args.threads}, {args.dtype}, M={args.m} K=N={args.kn}, "
        f"{'fwd+bwd' if args.grad else 'fwd no_grad'}, {args.rounds} rounds x {args.calls} calls, {dev}"
    )
    wbase = statistics.median(wall["nn.Linear"])
    print(
        f"{'piece':45s} {'median us':>10s} {'min us':>8s} {'vs nn.Linear':>13s}"
        + (f" {'wall us':>8s} {'wall vs nn':>10s}" if cuda else "")
    )
    for k, v in per.items():
        med = statistics.median(v)
        line = f"{k:45s} {med:10.2f} {min(v):8.2f} {med - base:+13.2f}"
        if cuda:
            wmed = statistics.median(wall[k])
            line += f" {wmed:8.2f} {wmed - wbase:+10.2f}"
        print(line)


if __name__ == "__main__":
    main()
