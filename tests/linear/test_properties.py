"""Property tests (hypothesis): ``scan`` against ``torch.isnan``/``torch.isinf`` and the guarded
linear against ``F.linear``, on random shapes (zero sizes included), random strided views and
randomly planted non-finite values.

How a view is built (``draw_view``): a random logical shape; a raw storage tensor laid out in a
random dim order (permutation), with a random step and offset per dim (slices), and some dims of
size 1 expanded (zero strides); sometimes a storage offset. Bad values are planted in the RAW
storage, so some land outside the view: those must NOT be counted (the scan must never read
outside the view), and the reference (``view.reshape(-1)``, logical row-major order) sees
exactly what the guard should see.

Deterministic by default (``derandomize=True``, no example database) so CI is reproducible.
``CUBLAS_GUARD_PROPERTY_EXAMPLES=500 CUBLAS_GUARD_PROPERTY_RANDOM=1`` explores further.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import cublas_guard_ext as cg

from helpers import DEVICES, assert_matches

SETTINGS = settings(
    max_examples=int(os.environ.get("CUBLAS_GUARD_PROPERTY_EXAMPLES", "60")),
    deadline=None,
    database=None,
    derandomize=os.environ.get("CUBLAS_GUARD_PROPERTY_RANDOM") != "1",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Bit patterns planted: quiet/signalling/negative NaNs, +-Inf; and finite extremes that must
# NOT count (-0.0, the smallest denormal, +-FLT_MAX).
BAD_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800000, 0xFF800000]
FINITE_EXTREMES = [0x80000000, 0x00000001, 0x7F7FFFFF, 0xFF7FFFFF]


def to_int32(pattern: int) -> int:
    return pattern - (1 << 32) if pattern >= (1 << 31) else pattern


def draw_view(
    data: st.DataObject,
    shape: list[int],
    device: str,
    *,
    allow_expand: bool = True,
    plant: bool = True,
    leaf: bool = False,
    extremes: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, raw): a view of logical ``shape`` into the random-layout storage ``raw``.

    ``extremes``: also plant +-FLT_MAX (finite, must not count; but they overflow a GEMM)."""
    k = len(shape)
    order = data.draw(st.permutations(range(k)), label="storage order") if k else []
    steps = [data.draw(st.integers(1, 3), label=f"step{d}") for d in range(k)]
    offsets = [data.draw(st.integers(0, 2), label=f"offset{d}") for d in range(k)]
    # about a quarter of the dims are expanded from size 1 (zero strides)
    expanded = [
        allow_expand and shape[d] > 0 and data.draw(st.integers(0, 3), label=f"expand{d}") == 0
        for d in range(k)
    ]
    base_shape = [1 if expanded[d] else shape[d] * steps[d] + offsets[d] for d in range(k)]
    storage_offset = data.draw(st.integers(0, 3), label="storage offset")
    numel = math.prod(base_shape)
    # The values come from hypothesis too (via the seed), so a failure replays exactly.
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    flat = torch.randn(numel + storage_offset, generator=gen).to(device)
    raw = flat[storage_offset:].view([base_shape[d] for d in order]) if k else flat[storage_offset:].view(())
    if plant and flat.numel():
        n_bad = data.draw(st.integers(0, 4), label="planted")
        ints = flat.view(torch.int32)
        for _ in range(n_bad):
            pos = data.draw(st.integers(0, flat.numel() - 1), label="raw position")
            pool = BAD_BITS + (FINITE_EXTREMES if extremes else FINITE_EXTREMES[:2])
            ints[pos] = to_int32(data.draw(st.sampled_from(pool), label="bits"))
    if leaf:
        raw = raw.detach().requires_grad_(True)
    inverse = [order.index(d) for d in range(k)]
    view = raw.permute(inverse) if k else raw
    index = tuple(
        slice(None) if expanded[d] else slice(offsets[d], offsets[d] + shape[d] * steps[d], steps[d])
        for d in range(k)
    )
    view = view[index] if k else view
    view = view.expand(shape) if k else view
    assert list(view.shape) == shape
    return view, raw


def reference(x: torch.Tensor) -> tuple[int, int, int, int]:
    flat = x.detach().reshape(-1)
    bad = ~torch.isfinite(flat)
    first = int(bad.nonzero()[0, 0]) if bool(bad.any()) else -1
    return (
        int(torch.isnan(flat).sum()),
        int(torch.isposinf(flat).sum()),
        int(torch.isneginf(flat).sum()),
        first,
    )


def unravel(index: int, shape: list[int]) -> list[int]:
    coords = []
    for size in reversed(shape):
        coords.append(index % size)
        index //= size
    return list(reversed(coords))


shapes = st.lists(st.integers(0, 6), min_size=0, max_size=5)
# Occasionally long 1-d/2-d ones, past the CPU scan's block (4096) and parallel grain (65536)
# and the CUDA single-block limit (32768).
long_shapes = st.sampled_from([[4097], [32769], [65537], [3, 40000], [70001, 1]])


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(data=st.data())
def test_scan_matches_isnan_isinf(device: str, data: st.DataObject) -> None:
    shape = data.draw(shapes | long_shapes, label="shape")
    view, raw = draw_view(data, shape, device)
    before = raw.detach().clone()
    event(
        f"ndim {view.dim()}, {'empty' if view.numel() == 0 else 'contiguous' if view.is_contiguous() else 'strided'}"
    )
    event("has bad values" if reference(view)[3] >= 0 else "all finite")
    result = cg.scan(view)
    got = (result.nan_count, result.posinf_count, result.neginf_count, result.first_bad_index)
    assert got == reference(view), (shape, view.stride())
    assert torch.equal(raw.view(torch.int32), before.view(torch.int32)), "scan wrote to its input"


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(data=st.data())
def test_linear_matches_f_linear_or_refuses_exactly(device: str, data: st.DataObject) -> None:
    """Any input/weight/bias views: F.linear's output and gradients when all are finite; else
    NonFiniteInputError naming the first bad operand (input, weight, bias) with the reference's
    counts, index and coordinates."""
    batch = data.draw(st.lists(st.integers(0, 5), min_size=0, max_size=3), label="batch")
    in_features = data.draw(st.integers(1, 17), label="in")
    out_features = data.draw(st.integers(1, 9), label="out")
    has_bias = data.draw(st.booleans(), label="bias")
    x, x_raw = draw_view(data, batch + [in_features], device, leaf=True, extremes=False)
    w, w_raw = draw_view(
        data,
        [out_features, in_features],
        device,
        leaf=True,
        extremes=False,
        plant=data.draw(st.integers(0, 3), label="plant weight") == 0,
    )
    b, b_raw = (
        draw_view(
            data,
            [out_features],
            device,
            leaf=True,
            extremes=False,
            plant=data.draw(st.booleans(), label="plant bias"),
        )
        if has_bias
        else (None, None)
    )
    leaves = [t for t in (x_raw, w_raw, b_raw) if t is not None]
    snapshots = [t.detach().clone() for t in leaves]

    first_bad = next(
        (
            (role, t)
            for role, t in (("input", x), ("weight", w), ("bias", b))
            if t is not None and reference(t)[3] >= 0
        ),
        None,
    )
    event(f"refused: {first_bad[0]}" if first_bad else ("empty output" if x.numel() == 0 else "computed"))
    event(f"input strides {'contiguous' if x.is_contiguous() else 'strided'}")
    if first_bad is not None:
        role, t = first_bad
        with pytest.raises(cg.NonFiniteInputError) as info:
            cg.linear(x, w, b, layer="prop")
        err = info.value
        nan, pos, neg, first = reference(t)
        assert (err.role, err.nan_count, err.posinf_count, err.neginf_count, err.first_bad_index) == (
            role,
            nan,
            pos,
            neg,
            first,
        )
        assert err.first_bad_coords == unravel(first, list(t.shape))
    else:
        y = cg.linear(x, w, b, layer="prop")
        ref = F.linear(x, w, b)
        assert_matches(y, ref)
        if y.numel():
            grad = torch.randn_like(y)
            got = torch.autograd.grad(y, leaves, grad, allow_unused=True)
            want = torch.autograd.grad(ref, leaves, grad, allow_unused=True)
            for g, r in zip(got, want):
                if r is None:
                    assert g is None or not g.any()
                else:
                    assert_matches(g, r)
    for t, snap in zip(leaves, snapshots):
        assert torch.equal(t.detach().view(torch.int32), snap.view(torch.int32)), "an operand changed"


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(data=st.data())
def test_check_features_agrees_with_scan(device: str, data: st.DataObject) -> None:
    shape = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=4), label="shape")
    x, _ = draw_view(data, shape, device)
    nan, pos, neg, first = reference(x)
    if first < 0:
        cg.check_features(x, shape[-1], name="prop")
    else:
        with pytest.raises(cg.NonFiniteInputError) as info:
            cg.check_features(x, shape[-1], name="prop")
        assert (
            info.value.nan_count,
            info.value.posinf_count,
            info.value.neginf_count,
            info.value.first_bad_index,
        ) == (nan, pos, neg, first)
    with pytest.raises(cg.ShapeMismatchError):
        cg.check_features(x, shape[-1] + 1, name="prop")


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(data=st.data())
def test_async_mode_reports_what_sync_mode_raises(device: str, data: st.DataObject) -> None:
    """The deferred report of an async call carries the same findings as a sync call's error."""
    shape = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3), label="batch") + [6]
    x, _ = draw_view(data, shape, device)
    w = torch.randn(3, 6, generator=torch.Generator().manual_seed(0)).to(device)
    expected = reference(x)
    y = cg.linear(x, w, None, layer="prop-async", mode="async")
    assert y.shape == (*shape[:-1], 3)
    if expected[3] < 0:
        cg.check()
        return
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    err = info.value
    assert err.deferred is True and err.layer == "prop-async" and err.role == "input"
    assert (err.nan_count, err.posinf_count, err.neginf_count, err.first_bad_index) == expected
    if len(shape) <= 8:
        assert err.first_bad_coords == unravel(expected[3], shape)
