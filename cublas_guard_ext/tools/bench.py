"""Side-by-side timing of SafeLinear against nn.Linear and of the scan against
the naive checks: the timing core of ``benchmarks/`` and the quick bench that
``python -m cublas_guard_ext bench`` and the demo print.

Every comparison is measured in one run, interleaved (round 1: A, B, C; round
2: A, B, C; ...) and reported from the medians of the rounds, as a ratio:
absolute times on shared machines drift, ratios measured together much less.

Timing:

* CPU: ``torch.utils.benchmark.Timer.blocked_autorange`` with all of torch's
  threads (the Timer's own default is one thread).
* CUDA: CUDA events around a batch of back-to-back calls, per-call time = batch
  time / calls. A batch measures the steady cost of a call as a training loop
  sees it: device time, or host time when the host is the bottleneck (small
  shapes), and for calls that synchronize (``mode="sync"``, ``bool(...)``) the
  synchronization too.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import benchmark

from ..guarded_linear import ops
from ..guarded_linear.nn import SafeLinear

__all__ = [
    "Row",
    "time_per_call",
    "interleaved",
    "rotating",
    "rotation_pool",
    "scan_decision",
    "isfinite_decision",
    "scan_bandwidth",
    "scan_bandwidth_rounds",
    "linear_forward",
    "scan_vs_isfinite",
    "format_table",
    "quick",
    "seed_check",
]


@dataclass
class Row:
    """One comparison: medians over the rounds, and the per-round ratios (its noise)."""

    label: str
    baseline_us: float
    guarded_us: float
    ratios: tuple[float, ...] = ()  # guarded / baseline, one per round (measured side by side)

    @property
    def ratio(self) -> float:
        return self.guarded_us / self.baseline_us

    def value(self, speedup: bool = False) -> float:
        """The reported effect: guarded/baseline, or baseline/guarded with ``speedup``."""
        return 1.0 / self.ratio if speedup else self.ratio

    def spread(self, speedup: bool = False) -> float:
        """Half the range of the per-round values: how much this run's rounds disagree (nan: unknown)."""
        values = [1.0 / r for r in self.ratios] if speedup else list(self.ratios)
        if len(values) < 2:
            return math.nan
        return (max(values) - min(values)) / 2

    def within_noise(self, speedup: bool = False) -> bool:
        """True when the spread is at least the effect (the distance of the value from 1.00x)."""
        spread = self.spread(speedup)
        return math.isnan(spread) or spread >= abs(self.value(speedup) - 1.0)


def _row(label: str, baseline: list[float], guarded: list[float]) -> Row:
    """A Row from per-round seconds (the rounds of ``interleaved``)."""
    return Row(
        label,
        statistics.median(baseline) * 1e6,
        statistics.median(guarded) * 1e6,
        tuple(g / b for b, g in zip(baseline, guarded)),
    )


# ---------------------------------------------------------------------------
# Timing core
# ---------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_per_call(fn: Callable[[], object], min_run_time: float) -> float:
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def _cuda_per_call(fn: Callable[[], object], device: torch.device, min_run_time: float) -> float:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    # One call to size the batch (and as a warm-up).
    start.record()
    fn()
    end.record()
    end.synchronize()
    one = max(start.elapsed_time(end) / 1e3, 1e-7)
    batch_target = max(min_run_time / 5, 1e-3)
    inner = max(1, min(20_000, int(batch_target / one)))
    per_call: list[float] = []
    total = 0.0
    while total < min_run_time or len(per_call) < 3:
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end) / 1e3
        per_call.append(elapsed / inner)
        total += elapsed
        if len(per_call) >= 50:
            break
    return statistics.median(per_call)


def time_per_call(fn: Callable[[], object], device: torch.device, min_run_time: float = 0.2) -> float:
    """Median seconds per call of ``fn`` on ``device`` (see the module docstring)."""
    if device.type == "cuda":
        return _cuda_per_call(fn, device, min_run_time)
    return _cpu_per_call(fn, min_run_time)


def interleaved(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    rounds: int = 3,
    min_run_time: float = 0.2,
    warmup: int = 2,
) -> dict[str, list[float]]:
    """Seconds per call of each function, one value per round; rounds interleave all of them.

    Each function is called ``warmup`` times first (lazy init, caches, cuBLAS
    handles). Take ``statistics.median`` of each list; compare medians.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            out[name].append(time_per_call(fn, device, min_run_time))
    return out


def rotating(tensors: list[torch.Tensor], fn: Callable[[torch.Tensor], object]) -> Callable[[], object]:
    """A no-argument function that applies ``fn`` to the next tensor of ``tensors`` each call.

    Rotating over buffers larger than the cache together keeps a scan from
    reading its input out of the cache on repeated calls.
    """
    if len(tensors) == 1:
        only = tensors[0]
        return lambda: fn(only)
    state = {"i": 0}
    count = len(tensors)

    def call() -> object:
        i = state["i"]
        state["i"] = i + 1 if i + 1 < count else 0
        return fn(tensors[i])

    return call


def rotation_pool(
    numel: int, device: torch.device, min_total_bytes: int, max_buffers: int = 256
) -> list[torch.Tensor]:
    """Views of one allocation: enough n-element float32 buffers to cover ``min_total_bytes``."""
    count = max(1, min(max_buffers, math.ceil(min_total_bytes / max(1, 4 * numel))))
    base = torch.randn(count * numel, device=device)
    return [base[i * numel : (i + 1) * numel] for i in range(count)]


# ---------------------------------------------------------------------------
# The checks being compared (each returns only once it has decided)
# ---------------------------------------------------------------------------
def scan_decision(x: torch.Tensor) -> bool:
    """The fused scan plus the host read that decides (a sync on CUDA)."""
    return ops.scan(x).all_finite


def isfinite_decision(x: torch.Tensor) -> bool:
    """``torch.isfinite(x).all()`` and its ``bool()`` (a sync on CUDA)."""
    return bool(torch.isfinite(x).all())


def seed_check(x: torch.Tensor) -> None:
    """The two-assert value check (``isnan(x).any()``, then ``isinf(x).any()``): the baseline
    the fused scan is measured against; two passes, two host reads."""
    assert not torch.isnan(x).any(), "NaN in input feature"
    assert not torch.isinf(x).any(), "Inf in input feature"


# ---------------------------------------------------------------------------
# The quick bench (demo and ``python -m cublas_guard_ext bench``)
# ---------------------------------------------------------------------------
def linear_forward(
    shapes: list[tuple[int, int, int]],
    modes: list[str],
    device: torch.device,
    rounds: int = 3,
    min_run_time: float = 0.2,
) -> list[Row]:
    """SafeLinear vs nn.Linear forward (same parameters, no_grad), per (M, K, N) and mode.

    All modes of one shape are measured interleaved with the baseline.
    """
    rows = []
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device)
        ref = nn.Linear(k, n, device=device)
        with torch.no_grad():
            fns: dict[str, Callable[[], object]] = {"nn.Linear": lambda: ref(x)}
            for mode in modes:
                safe = SafeLinear.from_linear(ref, mode=mode, name="bench")
                fns[mode] = lambda safe=safe: safe(x)
            times = interleaved(fns, device, rounds, min_run_time)
        for mode in modes:
            rows.append(_row(f"forward M={m} K={k} N={n} {mode}", times["nn.Linear"], times[mode]))
    return rows


def scan_vs_isfinite(
    sizes: list[int], device: torch.device, rounds: int = 3, min_run_time: float = 0.2
) -> list[Row]:
    """The scan with its decision (a host read) vs torch.isfinite(x).all() with its decision."""
    rows = []
    for n in sizes:
        x = torch.randn(n, device=device)
        times = interleaved(
            {"isfinite": lambda: isfinite_decision(x), "scan": lambda: scan_decision(x)},
            device,
            rounds,
            min_run_time,
        )
        rows.append(
            _row(f"scan n={n:,} vs isfinite().all(), with decisions", times["isfinite"], times["scan"])
        )
    return rows


def scan_bandwidth_rounds(
    n: int, device: torch.device, rounds: int = 3, min_run_time: float = 0.2
) -> tuple[list[float], list[float]]:
    """Per round: (scan GB/s with its decision, reference GB/s), measured side by side.

    The reference is ``x.sum()`` (reads x once) on CPU and a device-to-device
    copy (bytes read + written) on CUDA.
    """
    x = torch.randn(n, device=device)
    fns: dict[str, Callable[[], object]] = {"scan": lambda: scan_decision(x)}
    if device.type == "cuda":
        dst = torch.empty_like(x)
        fns["ref"] = lambda: dst.copy_(x)
        ref_bytes = 8 * n
    else:
        fns["ref"] = lambda: x.sum()
        ref_bytes = 4 * n
    times = interleaved(fns, device, rounds, min_run_time)
    return [4 * n / t / 1e9 for t in times["scan"]], [ref_bytes / t / 1e9 for t in times["ref"]]


def scan_bandwidth(
    n: int, device: torch.device, rounds: int = 3, min_run_time: float = 0.2
) -> tuple[float, float]:
    """(scan GB/s with its decision, reference GB/s): medians of :func:`scan_bandwidth_rounds`."""
    scan, ref = scan_bandwidth_rounds(n, device, rounds, min_run_time)
    return statistics.median(scan), statistics.median(ref)


def format_table(
    rows: list[Row], baseline_name: str = "baseline", guarded_name: str = "guarded", speedup: bool = False
) -> str:
    """One line per row; ``speedup`` shows baseline/guarded ("x faster") instead of guarded/baseline.

    A row whose rounds disagree by more than its effect (``Row.within_noise``)
    shows ``~`` instead of a ratio: this run measured no difference.
    """
    width = max(len(r.label) for r in rows)
    last = "faster" if speedup else "ratio"
    lines = [f"{'case':<{width}}  {baseline_name:>12}  {guarded_name:>12}  {last:>7}  {'noise':>6}"]
    for r in rows:
        spread = r.spread(speedup)
        noise = "    ?" if math.isnan(spread) else f"+-{spread:.2f}"
        value = f"{'~':>6} " if r.within_noise(speedup) else f"{r.value(speedup):>6.2f}x"
        lines.append(
            f"{r.label:<{width}}  {r.baseline_us:>10.1f}us  {r.guarded_us:>10.1f}us  {value}  {noise:>6}"
        )
    return "\n".join(lines)


QUICK_ROUNDS = 5
LEGEND = (
    "columns: the two times are medians of {rounds} interleaved rounds (microseconds per call);\n"
    "  ratio = SafeLinear / nn.Linear (1.10x: 10% slower); faster = isfinite / scan (2.00x: scan twice as fast);\n"
    "  noise = half the range of that ratio across the rounds, this run's own noise;\n"
    "  ~ = the noise is at least the difference from 1.00x: this run measured no difference."
)


def quick(device: torch.device) -> str:
    """The short benchmark the demo prints (about 15-20 s on a 2-core CPU)."""
    started = time.perf_counter()
    if device.type == "cuda":
        shapes = [(32, 1024, 1024), (8192, 4096, 4096)]
        sizes = [1 << 20, 1 << 26]
        bw_size = 1 << 26
    else:
        shapes = [(32, 1024, 1024), (1024, 1024, 1024)]
        sizes = [1 << 20, 1 << 24]
        bw_size = 1 << 24
    rounds, run_time = QUICK_ROUNDS, 0.06
    rows = linear_forward(shapes, ["sync", "async", "off"], device, rounds=rounds, min_run_time=run_time)
    text = format_table(rows, "nn.Linear", "SafeLinear")
    text += "\n\n" + format_table(
        scan_vs_isfinite(sizes, device, rounds=rounds, min_run_time=run_time),
        "isfinite",
        "scan",
        speedup=True,
    )
    scan_rounds, ref_rounds = scan_bandwidth_rounds(bw_size, device, rounds=rounds, min_run_time=run_time)
    scan_gbs, ref_gbs = statistics.median(scan_rounds), statistics.median(ref_rounds)
    fractions = [s / r for s, r in zip(scan_rounds, ref_rounds)]
    fraction_noise = (max(fractions) - min(fractions)) / 2
    ref_name = "device-to-device copy (read+write)" if device.type == "cuda" else "x.sum() (read)"
    text += f"\n\nscan of {bw_size:,} float32 with its decision: {scan_gbs:.1f} GB/s"
    if fraction_noise > 0.1 * statistics.median(fractions):
        text += (
            f"; its share of {ref_name} varied by +-{fraction_noise:.0%} between rounds: "
            "withheld (too noisy here, rerun on an idle machine)"
        )
    else:
        text += (
            f" = {statistics.median(fractions):.0%} +-{fraction_noise:.0%} of {ref_name} at "
            f"{ref_gbs:.1f} GB/s, measured side by side"
        )
    text += "\n" + LEGEND.format(rounds=rounds)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if device.type == "cpu" and load > 0.75 * (os.cpu_count() or 1):
        text += (
            f"\nNOTE: other work is running (load average {load:.1f} on {os.cpu_count()} cores): "
            "CPU figures are noisy, small cases wait for scheduler quanta"
        )
    text += (
        f"\n({device.type}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"{time.perf_counter() - started:.0f} s. Full suite: python benchmarks/run.py --preset "
        f"{'gpu' if device.type == 'cuda' else 'cpu'})"
    )
    return text
