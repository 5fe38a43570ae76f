"""The benchmark cases a preset (presets.py) chooses, and the measuring loop.

Every case is one *group*: all the functions compared in it are measured
interleaved, round after round, in one process (cublas_guard_ext.tools.bench.interleaved).
Reports use the medians of the rounds and ratios within a group only.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext.tools import bench

from .presets import Preset, cpu_mem_available

MODES = ("sync", "async", "off")
# Measured beside float32 (whose groups carry no dtype param: their keys stay those of the float32-only runs).
EXTRA_DTYPES = ("bfloat16", "float16", "float64")


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------
@dataclass
class Group:
    kind: str  # "linear" | "scan"
    params: dict
    members: list[str]

    def key(self) -> str:
        return self.kind + " " + " ".join(f"{k}={v}" for k, v in self.params.items())


def linear_flops(m: int, k: int, n: int, direction: str) -> int:
    gemms = 1 if direction == "fwd" else 3  # forward; + grad_input + grad_weight
    return 2 * m * k * n * gemms


def plan(p: Preset, device: torch.device, only: str | None = None) -> list[Group]:
    """The groups in the order they run: target cases first, then the rest by cost.

    ``only``: keep the groups of this kind ("fixed", "linear", "scan").
    """
    groups = _plan(p, device)
    return groups if only is None else [g for g in groups if g.kind == only]


def _plan(p: Preset, device: torch.device) -> list[Group]:
    tf32s = p.tf32 if device.type == "cuda" else [False]
    linear: list[Group] = []
    for m, k, n in p.linear_shapes:
        for tf32 in tf32s:
            for direction in p.directions:
                members = ["nn.Linear", *MODES]
                if direction == "fwd":
                    members += ["F.linear", "gemm_off"]
                    if p.gemm_nobias:
                        members += ["F.linear_nobias", "gemm_off_nobias"]
                linear.append(
                    Group("linear", {"M": m, "K": k, "N": n, "tf32": tf32, "direction": direction}, members)
                )
    first = [
        g
        for g in linear
        if (g.params["M"], g.params["K"], g.params["N"]) in p.target_shapes
        and g.params["direction"] == "fwd"
        and not g.params["tf32"]
    ]
    rest = [g for g in linear if g not in first]
    rest.sort(key=lambda g: linear_flops(g.params["M"], g.params["K"], g.params["N"], g.params["direction"]))
    scan: list[Group] = []
    for numel in p.scan_sizes:
        members = ["scan", "scan_op"]
        if numel <= p.slow_baseline_max:
            members += ["isfinite", "seed"]
        members += ["sum"]
        if device.type == "cuda":
            members += ["copy"]
        scan.append(Group("scan", {"numel": numel}, members))
    # Other dtypes: forward only, TF32 off; the scan against x.sum() (and the copy on CUDA).
    typed: list[Group] = []
    for dtype in EXTRA_DTYPES:
        for m, k, n in p.dtype_shapes:
            members = ["nn.Linear", *MODES, "F.linear", "gemm_off"]
            typed.append(
                Group(
                    "linear",
                    {"M": m, "K": k, "N": n, "tf32": False, "direction": "fwd", "dtype": dtype},
                    members,
                )
            )
        for numel in p.dtype_scan_sizes:
            members = ["scan", "scan_op", "sum"] + (["copy"] if device.type == "cuda" else [])
            typed.append(Group("scan", {"numel": numel, "dtype": dtype}, members))
    # bf16 first among them: its rows are targets.
    typed.sort(key=lambda g: g.params["dtype"] != "bfloat16")
    return first + fixed_plan(p) + scan + typed + rest


FIXED_MEMBERS = ("nn.Linear", "off", "async", "sync")


def fixed_plan(p: Preset) -> list[Group]:
    """The fixed-cost groups, small shapes first; right after the target cases."""
    groups = []
    for m, k, n in sorted(p.fixed_shapes, key=lambda s: s[0] * s[1] * s[2]):
        for dtype in p.fixed_dtypes:
            for threads in p.fixed_threads or [None]:
                for direction in p.fixed_directions:
                    params = {"M": m, "K": k, "N": n, "dtype": dtype, "direction": direction}
                    if threads is not None:
                        params["threads"] = threads
                    groups.append(Group("fixed", params, list(FIXED_MEMBERS)))
    return groups


def group_dtype(g: Group | dict) -> torch.dtype:
    params = g.params if isinstance(g, Group) else g
    return getattr(torch, params.get("dtype", "float32"))


# ---------------------------------------------------------------------------
# Running one group
# ---------------------------------------------------------------------------
def _linear_fns(g: Group, device: torch.device) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
    m, k, n, direction = g.params["M"], g.params["K"], g.params["N"], g.params["direction"]
    dtype = group_dtype(g)
    ref = nn.Linear(k, n, device=device, dtype=dtype)
    safe = {mode: cg.SafeLinear.from_linear(ref, mode=mode, name=f"bench.{mode}") for mode in MODES}
    w, b = ref.weight, ref.bias
    fns: dict[str, Callable[[], object]] = {}
    if direction == "fwd":
        x = torch.randn(m, k, device=device, dtype=dtype)
        grad_ctx = torch.no_grad
        fns["nn.Linear"] = lambda: ref(x)
        for mode in MODES:
            fns[mode] = lambda layer=safe[mode]: layer(x)
        fns["F.linear"] = lambda: F.linear(x, w, b)
        fns["gemm_off"] = lambda: cg.linear(x, w, b, layer="bench.gemm", mode="off")
        fns["F.linear_nobias"] = lambda: F.linear(x, w)
        fns["gemm_off_nobias"] = lambda: cg.linear(x, w, None, layer="bench.gemm", mode="off")
    else:
        x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
        grad_out = torch.randn(m, n, device=device, dtype=dtype)
        inputs = (x, w, b)
        grad_ctx = torch.enable_grad

        def step(layer: nn.Module) -> object:
            return torch.autograd.grad(layer(x), inputs, grad_out)

        fns["nn.Linear"] = lambda: step(ref)
        for mode in MODES:
            fns[mode] = lambda layer=safe[mode]: step(layer)
    chosen = {name: fns[name] for name in g.members}

    def wrap(fn: Callable[[], object]) -> Callable[[], object]:
        def call() -> object:
            with grad_ctx():
                return fn()

        return call

    def cleanup() -> None:
        cg.check()  # nothing should be recorded; raises if a scan found something

    return {name: wrap(fn) for name, fn in chosen.items()}, cleanup


def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or (60 << 20))


def _scan_fns(g: Group, device: torch.device) -> tuple[dict[str, Callable[[], object]], dict]:
    numel = g.params["numel"]
    dtype = group_dtype(g)
    itemsize = torch.empty((), dtype=dtype).element_size()
    ops = torch.ops.cublas_guard
    if device.type == "cuda" and dtype != torch.float32:
        count = max(1, -(-3 * _l2_bytes(device) // (itemsize * numel)))
        pool = [torch.randn(numel, device=device, dtype=dtype) for _ in range(count)]
        dst = [torch.empty_like(pool[0]) for _ in range(count)] if "copy" in g.members else []
    elif device.type == "cuda":
        pool = bench.rotation_pool(numel, device, min_total_bytes=3 * _l2_bytes(device))
        dst = (
            bench.rotation_pool(numel, device, min_total_bytes=3 * _l2_bytes(device))
            if "copy" in g.members
            else []
        )
    else:
        pool = [torch.randn(numel, device=device, dtype=dtype)]
        dst = []
    fns: dict[str, Callable[[], object]] = {
        "scan": bench.rotating(pool, bench.scan_decision),
        "scan_op": bench.rotating(pool, lambda x: ops.scan.default(x)),
        "isfinite": bench.rotating(pool, bench.isfinite_decision),
        "seed": bench.rotating(pool, bench.seed_check),
        "sum": bench.rotating(pool, lambda x: x.sum()),
    }
    if dst:
        pairs = list(zip(dst, pool))
        state = {"i": 0}

        def copy() -> object:
            i = state["i"]
            state["i"] = (i + 1) % len(pairs)
            d, s = pairs[i]
            return d.copy_(s)

        fns["copy"] = copy
    info = {
        "buffers": len(pool),
        "buffer_bytes": itemsize * numel,
        "rotated_bytes": itemsize * numel * len(pool),
    }
    if device.type == "cuda" and numel >= (1 << 26) and dtype == torch.float32:
        info["do_bench_ms"] = _do_bench_crosscheck(pool[0], dst[0] if dst else None)
    return {name: fns[name] for name in g.members}, info


def _do_bench_crosscheck(x: torch.Tensor, dst: torch.Tensor | None) -> dict | None:
    """triton.testing.do_bench (its own L2 flush, one call per event pair) for the scan kernel and
    the copy: a cross-check of the batched CUDA-event timer at the large sizes. None without triton."""
    try:
        from triton.testing import do_bench
    except Exception:  # noqa: BLE001 (optional)
        return None
    ops = torch.ops.cublas_guard
    try:
        out = {
            "scan_op": float(do_bench(lambda: ops.scan.default(x), warmup=10, rep=40, return_mode="median"))
        }
        if dst is not None:
            out["copy"] = float(do_bench(lambda: dst.copy_(x), warmup=10, rep=40, return_mode="median"))
    except Exception as err:  # noqa: BLE001 (a cross-check must not cost the run)
        return {"error": f"{type(err).__name__}: {err}"}
    return out


def _fits(g: Group, device: torch.device) -> str | None:
    """None if the group fits in memory, else why it is skipped."""
    if g.kind != "scan":
        return None
    nbytes = torch.empty((), dtype=group_dtype(g)).element_size() * g.params["numel"]
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        need = nbytes * (2 if "copy" in g.members else 1) + max(nbytes, 3 * _l2_bytes(device)) + nbytes // 2
        if need > 0.9 * free:
            return f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    else:
        need = int(nbytes * 1.6) + (256 << 20)
        avail = cpu_mem_available()
        if need > 0.8 * avail:
            return f"needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"
    return None


def _fixed_fns(g: Group, device: torch.device) -> dict[str, Callable[[], object]]:
    """One call of nn.Linear / SafeLinear per function, as a user makes it (the module call)."""
    m, k, n, direction = g.params["M"], g.params["K"], g.params["N"], g.params["direction"]
    dtype = group_dtype(g)
    ref = nn.Linear(k, n, device=device, dtype=dtype)
    layers: dict[str, nn.Module] = {"nn.Linear": ref}
    for mode in MODES:
        layers[mode] = cg.SafeLinear.from_linear(ref, mode=mode, name=f"fixed.{mode}")
    if direction == "fwd":
        x = torch.randn(m, k, device=device, dtype=dtype)
        return {name: (lambda layer=layer: layer(x)) for name, layer in layers.items()}
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(m, n, device=device, dtype=dtype)
    inputs = (x, ref.weight, ref.bias)
    return {
        name: (lambda layer=layer: torch.autograd.grad(layer(x), inputs, grad_out))
        for name, layer in layers.items()
    }


def time_fixed(
    fns: dict[str, Callable[[], object]], device: torch.device, rounds: int, min_time: float
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Host and wall seconds per call of each function, one value per round, interleaved.

    A batch of back-to-back calls per function and round: host time is the time
    until the last call returned; wall time adds the wait for the device
    (torch.cuda.synchronize; the same as host time on the CPU).
    """
    cuda = device.type == "cuda"
    for fn in fns.values():
        for _ in range(20):
            fn()
    if cuda:
        torch.cuda.synchronize(device)
    # Size the batch on the slowest function, the same count for all.
    t0 = time.perf_counter()
    probes = 0
    while time.perf_counter() - t0 < min_time / 4:
        for fn in fns.values():
            fn()
        probes += 1
    if cuda:
        torch.cuda.synchronize(device)
    per_call = (time.perf_counter() - t0) / (probes * len(fns))
    calls = max(5, min(20_000, int(min_time / max(per_call, 1e-7))))
    host: dict[str, list[float]] = {name: [] for name in fns}
    wall: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            returned = time.perf_counter()
            if cuda:
                torch.cuda.synchronize(device)
            done = time.perf_counter()
            host[name].append((returned - start) / calls)
            wall[name].append((done - start) / calls)
    return host, wall


def run_fixed(g: Group, device: torch.device, p: Preset) -> dict:
    started = time.perf_counter()
    record: dict = {"kind": g.kind, "params": dict(g.params), "members": list(g.members)}
    old_threads = torch.get_num_threads()
    old_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    try:
        if "threads" in g.params:
            torch.set_num_threads(int(g.params["threads"]))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        fns = _fixed_fns(g, device)
        # Forward under no_grad (grad mode off for the whole measurement: no per-call context manager).
        with torch.set_grad_enabled(g.params["direction"] != "fwd"):
            host, wall = time_fixed(fns, device, p.fixed_rounds, p.fixed_min_time)
        cg.check()  # nothing should be recorded; raises if a scan found something
    finally:
        torch.set_num_threads(old_threads)
        torch.backends.cuda.matmul.allow_tf32 = old_tf32[0]
        torch.set_float32_matmul_precision(old_tf32[1])
    record["rounds"] = p.fixed_rounds
    record["times_s"] = host
    record["median_s"] = {name: statistics.median(v) for name, v in host.items()}
    if device.type == "cuda":
        record["wall_times_s"] = wall
        record["wall_median_s"] = {name: statistics.median(v) for name, v in wall.items()}
    record["wall_s"] = time.perf_counter() - started
    return record


def run_group(g: Group, device: torch.device, p: Preset) -> dict:
    started = time.perf_counter()
    record: dict = {"kind": g.kind, "params": dict(g.params), "members": list(g.members)}
    skip = _fits(g, device)
    if skip:
        record["skipped"] = skip
        return record
    if g.kind == "fixed":
        return run_fixed(g, device, p)
    old_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    try:
        if g.kind == "linear":
            tf32 = bool(g.params["tf32"])
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.set_float32_matmul_precision("high" if tf32 else "highest")
            fns, cleanup = _linear_fns(g, device)
            rounds = p.rounds
            times = bench.interleaved(fns, device, rounds=rounds, min_run_time=p.min_run_time)
            cleanup()
        else:
            fns, info = _scan_fns(g, device)
            record.update(info)
            numel = g.params["numel"]
            # The CPU baselines take seconds per call at the largest sizes: fewer rounds there
            # (still interleaved) keep the preset inside its budget.
            rounds = p.rounds if (device.type == "cuda" or numel < (1 << 26)) else max(3, p.rounds - 2)
            times = bench.interleaved(fns, device, rounds=rounds, min_run_time=p.min_run_time)
        record["rounds"] = rounds
        record["times_s"] = times
        record["median_s"] = {name: statistics.median(v) for name, v in times.items()}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32[0]
        torch.set_float32_matmul_precision(old_tf32[1])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    record["wall_s"] = time.perf_counter() - started
    return record


def run(
    p: Preset, device: torch.device, budget_s: float | None = None, log=print, only: str | None = None
) -> list[dict]:
    budget = p.budget_s if budget_s is None else budget_s
    groups = plan(p, device, only=only)
    torch.manual_seed(0)
    started = time.perf_counter()
    records: list[dict] = []
    for i, g in enumerate(groups, 1):
        elapsed = time.perf_counter() - started
        if elapsed > budget:
            records.append(
                {
                    "kind": g.kind,
                    "params": dict(g.params),
                    "members": g.members,
                    "skipped": f"time budget of {budget:.0f} s spent",
                }
            )
            continue
        try:
            rec = run_group(g, device, p)
        except Exception as err:  # noqa: BLE001 (one failing case must not cost the whole run)
            traceback.print_exc()
            first = (str(err).strip().splitlines() or [""])[0][:200]
            rec = {
                "kind": g.kind,
                "params": dict(g.params),
                "members": g.members,
                "skipped": f"ERROR {type(err).__name__}: {first}",
            }
        records.append(rec)
        log(
            f"[{i:3d}/{len(groups)} {time.perf_counter() - started:6.1f}s] {g.key()}"
            + (f"  SKIPPED: {rec['skipped']}" if "skipped" in rec else f"  ({rec['wall_s']:.1f}s)")
        )
    return records


def thread_info() -> str:
    return f"{torch.get_num_threads()} torch threads (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})"
