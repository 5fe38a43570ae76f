"""The presets: which cases a run measures on which device, with how many rounds and what budget.

`cpu` fits this project's 2-core machine in under 10 minutes, `gpu` an H200 in about 4 (the full
benchmark grid), `quick` and `smoke` are fast looks (smoke exercises every code path with tiny sizes).
suite.py turns a preset into its cases and measures them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

GRID_M = (1, 32, 512, 4096, 8192)


GRID_KN = ((256, 256), (1024, 1024), (4096, 4096), (4096, 11008))


@dataclass
class Preset:
    name: str
    device: str  # "cpu" | "cuda" | "auto"
    linear_shapes: list[tuple[int, int, int]]
    directions: list[str]  # "fwd" (no_grad) | "fwd+bwd"
    tf32: list[bool]
    scan_sizes: list[int]
    slow_baseline_max: int  # largest numel for isfinite()/seed check (they are slow on CPU)
    rounds: int
    min_run_time: float
    budget_s: float
    target_shapes: list[tuple[int, int, int]] = field(default_factory=list)  # measured first
    gemm_nobias: bool = False
    note: str = ""
    # bf16/fp16/fp64 rows: forward (no_grad, TF32 off) at these shapes, the scan at these sizes.
    dtype_shapes: list[tuple[int, int, int]] = field(default_factory=list)
    dtype_scan_sizes: list[int] = field(default_factory=list)
    # The fixed cost per call: SafeLinear in each mode beside nn.Linear at
    # these shapes, dtypes, torch thread counts ([] = leave torch's) and directions.
    fixed_shapes: list[tuple[int, int, int]] = field(default_factory=list)
    fixed_dtypes: list[str] = field(default_factory=lambda: ["float32"])
    fixed_threads: list[int] = field(default_factory=list)
    fixed_directions: list[str] = field(default_factory=lambda: ["fwd", "fwd+bwd"])
    fixed_rounds: int = 15
    fixed_min_time: float = 0.01  # seconds per member per round

    def describe(self) -> dict:
        return asdict(self)


def _pow2_sizes(lo_log2: int, hi_log2: int, step: int = 2) -> list[int]:
    return [1 << e for e in range(lo_log2, hi_log2 + 1, step)]


def cpu_mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


CPU_SUBSET_NOTE = (
    "CPU subset of the benchmark grid (the 2-core CPU runs fp32 GEMMs at roughly 50-100 GFLOP/s, so "
    "M >= 4096 or M = 512 with K = 4096 would take seconds per call): M in {1, 32, 512} x (K, N) in "
    "{(256, 256), (1024, 1024)}; M in {1, 32} x (4096, 4096); M = 1 x (4096, 11008); plus the CPU "
    "target shape M = K = N = 1024. TF32 is a CUDA tensor-core mode: it does not exist on the CPU, "
    "so only TF32 off is measured here."
)


def preset(name: str) -> Preset:
    if name == "cpu":
        shapes = [(m, k, n) for m in (1, 32, 512) for k, n in ((256, 256), (1024, 1024))]
        shapes += [(1024, 1024, 1024), (1, 4096, 4096), (32, 4096, 4096), (1, 4096, 11008)]
        top = 28 if cpu_mem_available() >= (10 << 30) else 26
        return Preset(
            name="cpu",
            device="cpu",
            linear_shapes=shapes,
            directions=["fwd", "fwd+bwd"],
            tf32=[False],
            scan_sizes=_pow2_sizes(10, top),
            slow_baseline_max=1 << 28,
            rounds=5,
            min_run_time=0.1,
            budget_s=540.0,
            target_shapes=[(1024, 1024, 1024)],
            note=CPU_SUBSET_NOTE,
            dtype_shapes=[(32, 1024, 1024), (1024, 1024, 1024)],
            dtype_scan_sizes=[1 << 20, 1 << 24, 1 << 26],
            fixed_shapes=[(1, 16, 16), (32, 1024, 1024)],
            fixed_dtypes=["float32", "bfloat16"],
            fixed_threads=[1, 2],
        )
    if name == "gpu":
        shapes = [(m, k, n) for m in GRID_M for k, n in GRID_KN]
        return Preset(
            name="gpu",
            device="cuda",
            linear_shapes=shapes,
            directions=["fwd", "fwd+bwd"],
            tf32=[False, True],
            scan_sizes=_pow2_sizes(10, 30),
            slow_baseline_max=1 << 30,
            rounds=3,
            min_run_time=0.04,
            budget_s=150.0,
            target_shapes=[(8192, 4096, 4096), (32, 1024, 1024)],
            gemm_nobias=True,
            dtype_shapes=[(32, 1024, 1024), (8192, 4096, 4096)],
            dtype_scan_sizes=[1 << 20, 1 << 26, 1 << 28],
            # ~10 s: 4 groups of 4 members x 15 rounds x 10 ms, plus warm-up.
            fixed_shapes=[(32, 1024, 1024)],
            fixed_dtypes=["float32", "bfloat16"],
            note="The full benchmark grid: M in {1, 32, 512, 4096, 8192} x (K, N) in {(256, 256), "
            "(1024, 1024), (4096, 4096), (4096, 11008)}, TF32 off and on, forward and forward+backward.",
        )
    if name == "gpu-check":
        # The GPU check's target rows only (benchmarks/gpu/gpu_check.sh --run 1, about 15 s per
        # GEMM path on an H200): the forward at M=8192, K=N=4096 in every dtype against nn.Linear,
        # and the fixed cost per forward at M=32, K=N=1024.
        return Preset(
            name="gpu-check",
            device="cuda",
            linear_shapes=[(8192, 4096, 4096)],
            directions=["fwd"],
            tf32=[False],
            scan_sizes=[],
            slow_baseline_max=0,
            rounds=5,
            min_run_time=0.05,
            budget_s=40.0,
            target_shapes=[(8192, 4096, 4096)],
            dtype_shapes=[(8192, 4096, 4096)],
            dtype_scan_sizes=[],
            fixed_shapes=[(32, 1024, 1024)],
            fixed_dtypes=["float32"],
            fixed_directions=["fwd"],
            note="The GPU check's targets: forward at M=8192, K=N=4096 (float32 TF32 off, bfloat16, "
            "float16, float64) and the fixed cost per fp32 forward at M=32, K=N=1024.",
        )
    if name == "quick":
        return Preset(
            name="quick",
            device="auto",
            linear_shapes=[(32, 1024, 1024), (1024, 1024, 1024)],
            directions=["fwd", "fwd+bwd"],
            tf32=[False],
            scan_sizes=[1 << 10, 1 << 16, 1 << 20, 1 << 24],
            slow_baseline_max=1 << 24,
            rounds=3,
            min_run_time=0.05,
            budget_s=120.0,
            target_shapes=[(1024, 1024, 1024)],
            note="A small subset for a fast look; the targets need the cpu or gpu preset.",
            dtype_shapes=[(1024, 1024, 1024)],
            dtype_scan_sizes=[1 << 20],
            fixed_shapes=[(1, 16, 16), (32, 1024, 1024)],
            fixed_rounds=7,
        )
    if name == "smoke":
        return Preset(
            name="smoke",
            device="auto",
            linear_shapes=[(4, 16, 8), (32, 64, 32)],
            directions=["fwd", "fwd+bwd"],
            tf32=[False, True],
            scan_sizes=[1 << 10, 1 << 14],
            slow_baseline_max=1 << 14,
            rounds=1,
            min_run_time=0.005,
            budget_s=60.0,
            target_shapes=[(32, 64, 32)],
            gemm_nobias=True,
            note="Exercises every code path with tiny sizes (tests the suite, measures nothing useful).",
            dtype_shapes=[(32, 64, 32)],
            dtype_scan_sizes=[1 << 14],
            fixed_shapes=[(1, 16, 16)],
            fixed_dtypes=["float32", "bfloat16"],
            fixed_threads=[1],
            fixed_rounds=2,
            fixed_min_time=0.001,
        )
    raise ValueError(f"unknown preset {name!r}")


PRESETS = ("cpu", "gpu", "gpu-check", "quick", "smoke")


def resolve_device(p: Preset, override: str | None) -> torch.device:
    want = override or p.device
    if want == "auto":
        has_cuda_ops = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
            "cublas_guard::linear", "CUDA"
        )
        want = "cuda" if has_cuda_ops else "cpu"
    return torch.device(want)
