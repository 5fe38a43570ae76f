"""Quick side-by-side timings of SafeLinear against nn.Linear (the demo's and
``python -m cublas_guard_ext bench``'s). The full suite is in ``benchmarks/``.

Every comparison is measured in one run, interleaved, and reported as a ratio:
absolute times on shared machines drift, ratios measured together do not.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import benchmark

from . import ops
from .nn import SafeLinear


@dataclass
class Row:
    label: str
    baseline_us: float
    guarded_us: float

    @property
    def ratio(self) -> float:
        return self.guarded_us / self.baseline_us


def _median_us(fn, min_run_time: float) -> float:
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn})
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


def _interleaved(base, guarded, device: torch.device, rounds: int, min_run_time: float) -> tuple[float, float]:
    """Alternate the two measurements so drift hits both alike; medians of the rounds."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn):
        def run():
            fn()
            sync()

        return run

    base_t, guarded_t = [], []
    for _ in range(rounds):
        base_t.append(_median_us(timed(base), min_run_time))
        guarded_t.append(_median_us(timed(guarded), min_run_time))
    return statistics.median(base_t), statistics.median(guarded_t)


def linear_forward(
    shapes: list[tuple[int, int, int]],
    modes: list[str],
    device: torch.device,
    rounds: int = 3,
    min_run_time: float = 0.2,
) -> list[Row]:
    """SafeLinear vs nn.Linear forward (same parameters), per (M, K, N) and mode."""
    rows = []
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device)
        ref = nn.Linear(k, n, device=device)
        with torch.no_grad():
            for mode in modes:
                safe = SafeLinear.from_linear(ref, mode=mode, name="bench")
                base, guarded = _interleaved(
                    lambda: ref(x), lambda safe=safe: safe(x), device, rounds, min_run_time
                )
                rows.append(Row(f"forward M={m} K={k} N={n} {mode}", base, guarded))
    return rows


def scan_vs_isfinite(sizes: list[int], device: torch.device, rounds: int = 3, min_run_time: float = 0.2) -> list[Row]:
    """The scan with its decision (a host read) vs torch.isfinite(x).all() with its decision."""
    rows = []
    for n in sizes:
        x = torch.randn(n, device=device)
        base, guarded = _interleaved(
            lambda: bool(torch.isfinite(x).all()),
            lambda: ops.scan(x).all_finite,
            device,
            rounds,
            min_run_time,
        )
        rows.append(Row(f"scan n={n:,} vs isfinite().all()", base, guarded))
    return rows


def format_table(rows: list[Row], baseline_name: str = "baseline") -> str:
    width = max(len(r.label) for r in rows)
    lines = [f"{'case':<{width}}  {baseline_name:>12}  {'guarded':>12}  {'ratio':>7}"]
    for r in rows:
        lines.append(
            f"{r.label:<{width}}  {r.baseline_us:>10.1f}us  {r.guarded_us:>10.1f}us  {r.ratio:>6.2f}x"
        )
    return "\n".join(lines)


def quick(device: torch.device) -> str:
    """The short benchmark the demo prints."""
    if device.type == "cuda":
        shapes = [(32, 1024, 1024), (8192, 4096, 4096)]
        sizes = [1 << 20, 1 << 26]
    else:
        shapes = [(32, 1024, 1024), (1024, 1024, 1024)]
        sizes = [1 << 20, 1 << 24]
    rows = linear_forward(shapes, ["sync", "off"], device)
    text = format_table(rows, "nn.Linear")
    text += "\n\n" + format_table(scan_vs_isfinite(sizes, device), "isfinite")
    return text
