"""No leaks: 10,000 forward+backward training steps with constant memory, including steps that
raise (bad values, wrong shapes, injected cuBLAS faults in backward), in sync and async modes.

Memory is measured after a warm-up (allocator pools, lazy imports, the parameter cache filled):
process RSS on CPU (/proc/self/statm), ``torch.cuda.memory_allocated`` on the GPU (exact).
The numbers are printed (run with ``-s`` to see them).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg

from helpers import allocated, assert_matches, memory_growth, requires_cuda, rss_bytes

STEPS = 10_000
WARMUP = 1_000
QUICK_STEPS = 2_000  # the GPU quick variant: allocated bytes are exact, so any per-step leak shows

# cpu and cuda run the full count and are marked slow; "cuda-quick" (not slow) is what
# benchmarks/gpu/gpu_check.sh runs (it runs `-m "not slow"`) within its test budget.
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.slow),
    pytest.param("cuda-quick", marks=requires_cuda),
    pytest.param("cuda", marks=[pytest.mark.slow, requires_cuda]),
]


def steps_for(device: str) -> tuple[str, int, int]:
    """(torch device, steps, warm-up steps)"""
    if device == "cuda-quick":
        return "cuda", QUICK_STEPS, 200
    return device, STEPS, WARMUP


RSS_TOLERANCE = 2 * 2**20  # bytes; a leak of ~200 B per step would already exceed it (noise: ~0.1 MiB)


@pytest.fixture
def one_thread():
    """Small ops on an oversubscribed 2-core machine: one intra-op thread keeps the timing
    stable (OpenMP spin-waits otherwise dominate); restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ten_thousand_steps_with_errors_constant_memory(
    device: str, mode: str, one_thread, inject_fault
) -> None:
    device, steps, warmup = steps_for(device)
    torch.manual_seed(0)
    model = cg.replace_linear(nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4)), mode=mode).to(
        device
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    good = torch.randn(8, 32, device=device)
    bad = good.clone()
    bad[3, 5] = float("nan")
    wrong = torch.randn(8, 31, device=device)
    target = torch.randn(8, 4, device=device)
    inject_fault("gemm", 0)  # registers the site for cleanup; armed per step below
    counts = {"ok": 0, "nan": 0, "shape": 0, "fault": 0}

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        if i % 11 == 5:  # a NaN input
            # sync: layer "0" raises. async: layer "0" records it and returns; on the CPU
            # the next guarded call, layer "2" in this same forward, raises layer "0"'s
            # record; on a GPU the record lands whenever the scan finishes, so check() waits.
            with pytest.raises(cg.NonFiniteInputError) as info:
                model(bad)
                if device == "cuda":
                    cg.check()
            assert info.value.layer == "0"
            assert bool(info.value.fields.get("deferred")) == (mode == "async")
            counts["nan"] += 1
            return
        if i % 13 == 7:  # a wrong shape: raises at once in every mode
            with pytest.raises(cg.ShapeMismatchError):
                model(wrong)
            counts["shape"] += 1
            return
        loss = F.mse_loss(model(good), target)
        if i % 17 == 3:  # a cuBLAS failure in backward
            torch.ops.cublas_guard_testing.set_fault("gemm", 13, 1)
            with pytest.raises(cg.CublasError):
                loss.backward()
            counts["fault"] += 1
            return
        loss.backward()
        opt.step()  # bumps the parameters' versions: they are scanned again next call
        counts["ok"] += 1

    for i in range(warmup):
        step(i)
    gc.collect()
    rss0, gpu0 = rss_bytes(), allocated(device)
    checkpoints = []
    for i in range(warmup, warmup + steps):
        step(i)
        if (i - warmup + 1) % (steps // 4) == 0:
            gc.collect()
            checkpoints.append(((rss_bytes() - rss0) // 1024, allocated(device) - gpu0))
    rss1, gpu1 = rss_bytes(), allocated(device)
    print(
        f"\n[leaks/{device}/{mode}] {steps} steps after {warmup} warm-up ({counts}): "
        f"RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB ({(rss1 - rss0) / 2**10:+.0f} KiB), "
        f"GPU allocated {gpu0} -> {gpu1} B; growth at each quarter (KiB, B): {checkpoints}"
    )
    n = warmup + steps  # each kind of failure really happened, many times
    assert counts["nan"] >= n // 11 and counts["shape"] >= n // 15 and counts["fault"] >= n // 22
    assert rss1 - rss0 < RSS_TOLERANCE, f"RSS grew {(rss1 - rss0) / 2**20:.1f} MiB"
    assert gpu1 == gpu0, f"GPU allocated bytes grew by {gpu1 - gpu0}"
    cg.check()
    # still correct after all that
    x = torch.randn(5, 32, device=device)
    ref = F.linear(F.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias)
    assert_matches(model(x), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_fresh_parameters_every_call_do_not_grow_the_cache(device: str, one_thread) -> None:
    """The clean-parameter cache is keyed by tensor: 10,000 calls with a fresh weight each
    (functional use, or re-created layers) must not keep memory for the dead ones."""
    device, steps, _ = steps_for(device)
    x = torch.randn(4, 16, device=device)

    def call(_: int) -> None:
        w = torch.randn(8, 16, device=device, requires_grad=True)
        b = torch.randn(8, device=device, requires_grad=True)
        cg.linear(x, w, b, layer="fresh").sum().backward()

    # warm-up: the cache evicts dead entries as new ones come, so its size is steady after it
    rss0, rss1, gpu0, gpu1 = memory_growth(call, 5_000, steps, device)
    print(
        f"\n[leaks/{device}/fresh-params] {steps} calls: RSS {(rss1 - rss0) / 2**10:+.0f} KiB, "
        f"GPU {gpu1 - gpu0:+d} B"
    )
    assert rss1 - rss0 < RSS_TOLERANCE
    assert gpu1 == gpu0


@pytest.mark.parametrize("device", DEVICES)
def test_scan_and_check_features_do_not_leak(device: str, one_thread) -> None:
    device, steps, _ = steps_for(device)
    x = torch.randn(64, 33, device=device)
    bad = x.clone()
    bad[10, 3] = float("inf")

    def call(i: int) -> None:
        assert cg.scan(x[:, 1:]).first_bad_index == -1
        if i % 5 == 0:
            with pytest.raises(cg.NonFiniteInputError):
                cg.check_features(bad, 33, name="features")
        else:
            cg.check_features(x, 33, name="features")

    rss0, rss1, gpu0, gpu1 = memory_growth(call, 1_000, steps, device)
    print(
        f"\n[leaks/{device}/scan] {steps} scans + checks: RSS {(rss1 - rss0) / 2**10:+.0f} KiB, "
        f"GPU {gpu1 - gpu0:+d} B"
    )
    assert rss1 - rss0 < RSS_TOLERANCE
    assert gpu1 == gpu0
