"""watch: outputs finite by their inputs' value bounds are not scanned (issue 20, CPU cost).

csrc/watch/watch_bounds.cpp. The CPU scan's range pass gives every finite tensor it reads an
interval; an op whose output interval (with a rounding allowance) stays far below the dtype's
largest finite value is not scanned, and its output is remembered with that interval. The risk
is a skipped scan that would have found a non-finite value, or an interval that misses a value
(which a later op would trust): the random tests below run every rule on inputs near the limits
of float32, bfloat16 and float16 and check both against the values themselves.
"""

from __future__ import annotations

import importlib
import math
import random

import pytest
import torch

import cublas_guard_ext as cg

_native = importlib.import_module("cublas_guard_ext.watch")._native

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _scans(w) -> int:
    return w.stats()[1]


# -- the range pass ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 31, 64, 1000, 70_001, 300_000])  # tails, one task, several tasks
@pytest.mark.parametrize("kind", ["signed", "positive", "negative", "zeros", "negative_zeros"])
def test_the_range_pass_gives_the_exact_largest_magnitudes(dtype, n, kind):
    g = torch.Generator().manual_seed(n)
    base = torch.randn(n, generator=g) * 7.0
    values = {
        "signed": base,
        "positive": base.abs() + 0.5,
        "negative": -(base.abs() + 0.5),
        "zeros": torch.zeros(n),
        "negative_zeros": torch.full((n,), -0.0),
    }[kind]
    src = values.to(dtype)
    with cg.watch(None, mode="sync"):
        x = _made(src)
        known = _native.known_range(x)
    assert known is not None
    lo, hi = known
    x64 = x.double()
    assert hi == x64.abs().max().item()
    assert lo == x64.min().item()


def test_a_non_finite_value_is_counted_as_before():
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            x = torch.arange(100.0)
            torch.log(x - 50.0)  # 50 NaN, one -Inf at index 50
    assert info.value.nan_count == 50 and info.value.neginf_count == 1 and info.value.first_bad_index == 0


# -- the optimizer's chain -----------------------------------------------------------------------


def test_an_adamw_step_scans_only_the_state_it_reads():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn(64, 64)
    opt.step()  # outside any block: the state's versions move, so the block scans each once
    state = opt.state[p]
    with cg.watch(None, mode="sync") as w:
        p.grad = torch.randn(64, 64) * 1.0  # made in the block: known, with bounds
        before = _scans(w)
        opt.step()
        scanned = _scans(w) - before
        ranges = {name: _native.known_range(t) for name, t in [("param", p), *state.items()]}
    # the step counter, the parameter (weight decay's mul_), exp_avg (lerp_) and exp_avg_sq
    # (mul_) are read once each; lerp_, addcmul_, sqrt, div, add_ and addcdiv_ are bounded
    assert scanned == 4
    for name, t in [("param", p), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])]:
        lo, hi = ranges[name]
        assert lo <= t.min().item() and t.max().item() <= hi, name
    assert ranges["exp_avg_sq"][0] == 0.0  # non-negative: its square root needs no scan


def test_the_next_block_scans_nothing_of_a_state_it_wrote():
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(32, 32))
    opt = torch.optim.AdamW([p], lr=1e-3)
    for _ in range(3):  # a loop watched at every step: what a block wrote stays known
        with cg.watch(None, mode="sync") as w:
            p.grad = torch.randn(32, 32) * 1.0
            before = _scans(w)
            opt.step()
            scanned = _scans(w) - before
    assert scanned == 0
    assert torch.isfinite(p).all()


# -- each rule: bounded inputs are spared; an overflow is still scanned and named ---------------


def _made(values: torch.Tensor) -> torch.Tensor:
    """`values`, made inside the block by an op that scans them (their values unknown until
    then): known, with the range pass's bounds. x * 1.0 is exact, -0.0 included."""
    return torch.ops.aten.mul(values, 1.0)


_SPARED = {
    "mul_scalar": lambda a, b, c: a * -3.0,
    "rmul_scalar": lambda a, b, c: 3.0 * a,
    "mul_tensors": lambda a, b, c: a * b,
    "mul_": lambda a, b, c: a.mul_(b),
    "div_scalar": lambda a, b, c: a / 1e-3,
    "add_scalar": lambda a, b, c: a + 1e30,
    "add_tensors": lambda a, b, c: torch.add(a, b, alpha=-2.0),
    "sub_": lambda a, b, c: a.sub_(b, alpha=3.0),
    "lerp_": lambda a, b, c: a.lerp_(b, 0.9),
    "lerp": lambda a, b, c: torch.lerp(a, b, 0.1),
    "addcmul_": lambda a, b, c: a.addcmul_(b, c, value=-2.0),
    "addcmul_square": lambda a, b, c: c.addcmul(b, b, value=0.5),
    "addcdiv_": lambda a, b, c: a.addcdiv_(b, c, value=-1e-3),
    "sqrt": lambda a, b, c: c.sqrt(),
    "sqrt_": lambda a, b, c: c.sqrt_(),
}


@pytest.mark.parametrize("name", sorted(_SPARED))
def test_bounded_inputs_spare_the_scan(name):
    g = torch.Generator().manual_seed(7)
    with cg.watch(None, mode="sync") as w:
        a = _made(torch.randn(50, generator=g))
        b = _made(torch.randn(50, generator=g))
        c = _made(torch.rand(50, generator=g) + 0.5)  # positive: a denominator, a square root's input
        before = _scans(w)
        out = _SPARED[name](a, b, c)
        assert _scans(w) == before, name
        lo, hi = _native.known_range(out)
    assert lo <= out.min().item() and out.max().item() <= hi


_OVERFLOWS = {
    "mul_scalar": ("aten.mul.Tensor", lambda a, b, c: (c + 10.0) * 1e38),
    "mul_tensors": ("aten.mul.Tensor", lambda a, b, c: (a * 1e20) * (b * 1e20)),
    "div_scalar": ("aten.div.Tensor", lambda a, b, c: (a * 1e30) / 1e-10),
    "add_scalar": ("aten.add.Tensor", lambda a, b, c: (a * 1e38 + 3e38) + 3e38),
    "lerp_outside_0_1": ("aten.lerp_.Scalar", lambda a, b, c: (a * 1e38).lerp_(b * 1e38, 3.0)),
    "lerp_of_large_values": (
        "aten.lerp.Scalar",
        lambda a, b, c: torch.lerp(_made(torch.full((4,), 2e38)), _made(torch.full((4,), -2e38)), 0.5),
    ),
    "addcmul_": ("aten.addcmul_.default", lambda a, b, c: a.addcmul_(b * 1e20, b * 1e20)),
    "addcdiv_zero_denominator": ("aten.addcdiv_.default", lambda a, b, c: a.addcdiv_(c, c * 0.0)),
    "sqrt_of_negatives": ("aten.sqrt.default", lambda a, b, c: a.sqrt()),
}


@pytest.mark.parametrize("name", sorted(_OVERFLOWS))
def test_an_output_that_can_overflow_is_scanned_and_named(name):
    op, fn = _OVERFLOWS[name]
    g = torch.Generator().manual_seed(8)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            a = _made(torch.randn(50, generator=g))
            b = _made(torch.randn(50, generator=g))
            c = _made(torch.rand(50, generator=g) + 0.5)
            fn(a, b, c)
    assert info.value.op == op


def test_unknown_inputs_and_other_dtypes_are_scanned():
    outside = torch.randn(50)  # made before the block: no bounds
    with cg.watch(None, mode="sync") as w:
        before = _scans(w)
        outside.lerp(outside, 0.5)
        assert _scans(w) > before
        d = _made(torch.randn(50)).double()  # float64: the range pass does not take it
        before = _scans(w)
        d * 2.0
        assert _scans(w) > before


# -- random inputs near the limits: nothing non-finite is spared, every interval holds ----------

_RULES = {
    "mul_scalar": lambda a, b, c, s: a * s,
    "mul_tensors": lambda a, b, c, s: a * b,
    "div_scalar": lambda a, b, c, s: a / s,
    "add_scalar": lambda a, b, c, s: a + s,
    "sub_tensors": lambda a, b, c, s: torch.sub(a, b, alpha=s),
    "lerp_": lambda a, b, c, s: a.lerp_(b, abs(s) / (1.0 + abs(s))),
    "addcmul_": lambda a, b, c, s: a.addcmul_(b, c, value=s),
    "addcmul_square": lambda a, b, c, s: c.addcmul_(b, b, value=abs(s)),
    "addcdiv_": lambda a, b, c, s: a.addcdiv_(b, c, value=s),
    "sqrt_then_add": lambda a, b, c, s: c.sqrt().add_(abs(s)),
}


def _limit(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rule", sorted(_RULES))
def test_random_inputs_near_the_limits(dtype, rule):
    rng = random.Random(f"{rule}-{dtype}")
    limit = _limit(dtype)
    top = math.log2(limit)
    spared = scanned = 0
    for _ in range(40):
        seed = rng.randrange(1 << 30)
        g = torch.Generator().manual_seed(seed)

        # magnitudes from tiny to the largest finite value, half of them within 2**4 of it, so
        # that each rule's outputs cross a quarter of it both ways
        def exponent(low: float) -> float:
            return top - rng.uniform(0.5, 4.0) if rng.random() < 0.5 else rng.uniform(low, top - 0.5)

        scale = [2.0 ** exponent(-0.6 * top) for _ in range(3)]
        s = rng.choice([-1.0, 1.0]) * 2.0 ** exponent(-top)
        a0 = (torch.randn(40, generator=g) * scale[0]).clamp(-limit / 2, limit / 2).to(dtype)
        b0 = (torch.randn(40, generator=g) * scale[1]).clamp(-limit / 2, limit / 2).to(dtype)
        c0 = (torch.rand(40, generator=g) * scale[2] + scale[2] / 4).clamp(max=limit / 2).to(dtype)
        finding = None
        try:
            with cg.watch(None, mode="async", report="birth") as w:
                a, b, c = (_made(t) for t in (a0, b0, c0))
                before = _scans(w)
                out = _RULES[rule](a, b, c, s)
                was_spared = _scans(w) == before
                known = _native.known_range(out)
        except cg.NonFiniteOutputError as e:
            finding = e
        values = out.double()
        finite = bool(torch.isfinite(values).all())
        context = f"{rule} {dtype} seed {seed} scale {scale} s {s}"
        if not finite:
            assert not was_spared, "a non-finite output was spared: " + context
            assert finding is not None, context
        else:
            assert finding is None, context
            if known is not None:
                assert known[0] <= values.min().item() and values.max().item() <= known[1], context
        spared += was_spared
        scanned += not was_spared
    assert spared > 0 and scanned > 0  # both sides of the rule were exercised
