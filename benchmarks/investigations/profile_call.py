"""Where one small SafeLinear call spends its host time, by op, beside nn.Linear.

torch.profiler over a batch of forward calls under no_grad at M=32, K=N=1024 (the GPU goal's shape),
per layer: nn.Linear, SafeLinear off and async. The table lists every dispatcher op (ours and the
aten ops they call: empty, expand, copy_, ...) and, on CUDA, the runtime calls (cudaLaunchKernel,
cuBLAS's), by self CPU time, so the next device run shows at once which piece makes the gap.

    python benchmarks/investigations/profile_call.py [--device cuda] [--calls 200]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import cublas_guard_ext as cg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--kn", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=18)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    x = torch.randn(args.m, args.kn, device=dev)
    ref = torch.nn.Linear(args.kn, args.kn, device=dev)
    layers = {"nn.Linear": ref}
    for mode in ("off", "async"):
        layers[f"SafeLinear {mode}"] = cg.SafeLinear.from_linear(ref, mode=mode, name=f"profile.{mode}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad():
        for name, layer in layers.items():
            for _ in range(50):
                layer(x)
            if cuda:
                torch.cuda.synchronize(dev)
            with profile(activities=activities) as prof:
                for _ in range(args.calls):
                    layer(x)
                if cuda:
                    torch.cuda.synchronize(dev)
            print(f"==== {name}: {args.calls} calls at M={args.m}, K=N={args.kn} on {dev}, by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    cg.check()


if __name__ == "__main__":
    main()
