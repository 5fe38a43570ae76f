"""The GOOD half of the input matrix: strided and zero-size inputs, layers with zero
features and sizes at and beyond the 32-bit limit give F.linear's results and gradients."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers import assert_matches
from helpers.inputs import NAME, Snapshot, make_layer

# --------------------------------------------------------------------------
# GOOD strided and zero-size inputs: F.linear's result and gradients
# --------------------------------------------------------------------------
GOOD: dict[str, Callable[[str], torch.Tensor]] = {
    "transposed": lambda d: torch.randn(8, 5, device=d).t(),
    "step-slice": lambda d: torch.randn(5, 16, device=d)[:, ::2],
    "row-step-slice": lambda d: torch.randn(10, 8, device=d)[::2],
    "column-slice": lambda d: torch.randn(4, 20, device=d)[:, 5:13],
    "expanded-batch": lambda d: torch.randn(1, 8, device=d).expand(5, 8),
    "expanded-features": lambda d: torch.randn(5, 1, device=d).expand(5, 8),
    "expanded-scalar": lambda d: torch.randn((), device=d).expand(3, 4, 8),
    "offset-view": lambda d: torch.randn(101, device=d)[3:43].view(5, 8),
    "offset-odd-3d": lambda d: torch.randn(200, device=d)[1:49].view(2, 3, 8),
    "overlapping": lambda d: torch.randn(100, device=d).as_strided((5, 8), (2, 1)),
    "permuted-3d": lambda d: torch.randn(8, 2, 3, device=d).permute(1, 2, 0),
    "both-dims-strided": lambda d: torch.randn(10, 24, device=d)[::2, ::3],
    "channels-last-4d": lambda d: (
        torch.randn(2, 8, 3, 3, device=d).contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1)
    ),
    "negative-view": lambda d: torch.randn(3, 8, device=d)._neg_view(),
    "1d": lambda d: torch.randn(8, device=d),
    "5d": lambda d: torch.randn(2, 1, 3, 2, 8, device=d),
    "zero-batch": lambda d: torch.randn(0, 8, device=d),
    "zero-middle-dim": lambda d: torch.randn(2, 0, 8, device=d),
    "zero-batch-strided": lambda d: torch.randn(8, 0, device=d).t(),
    "single-row": lambda d: torch.randn(1, 8, device=d),
}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("name", list(GOOD))
def test_good_strided_and_zero_size_inputs(device: str, name: str, bias: bool) -> None:
    safe = make_layer(device, bias=bias)
    x = GOOD[name](device)
    before = Snapshot.of(x)
    y = safe(x)
    ref = F.linear(x, safe.weight, safe.bias)
    assert_matches(y, ref)
    before.assert_same(x)
    # gradients through the same view
    leaf = x.detach().clone().requires_grad_(True)
    leaf_ref = x.detach().clone().requires_grad_(True)
    params = [p for p in (safe.weight, safe.bias) if p is not None]
    y, ref = safe(leaf), F.linear(leaf_ref, safe.weight, safe.bias)
    if y.numel():
        grad = torch.randn_like(y)
        for got, want in zip(
            torch.autograd.grad(y, [leaf, *params], grad), torch.autograd.grad(ref, [leaf_ref, *params], grad)
        ):
            assert_matches(got, want)


@pytest.mark.parametrize("shape", [(3, 0), (0, 0)], ids=["in0", "in0-batch0"])
def test_zero_in_features_layer(device: str, shape: tuple[int, int]) -> None:
    """in_features = 0: an empty sum, so the output is the bias broadcast (cuBLAS never sees k=0)."""
    safe = cg.SafeLinear(0, 4, device=device, name=NAME)
    x = torch.randn(shape, device=device)
    assert_matches(safe(x), F.linear(x, safe.weight, safe.bias))


def test_zero_out_features_layer(device: str) -> None:
    safe = cg.SafeLinear(8, 0, device=device, name=NAME)
    x = torch.randn(3, 8, device=device)
    assert safe(x).shape == (3, 0)


def test_size_limit_boundary_is_inclusive(device: str, size_limit) -> None:
    """Exactly at the limit is one call; one past it is refused without the 64-bit API and
    works with it; a batch past it is split (any batch, with or without the 64-bit API)."""
    size_limit(20, allow_64bit=False)
    at = cg.SafeLinear(20, 20, device=device, name=NAME)
    x = torch.randn(20, 20, device=device)
    assert_matches(at(x), F.linear(x, at.weight, at.bias))
    past = cg.SafeLinear(20, 21, device=device, name=NAME)
    with pytest.raises(cg.SizeLimitError, match="argument m = 21"):
        past(x)
    for rows in (21, 40, 41, 0):
        xr = torch.randn(rows, 20, device=device)
        assert_matches(at(xr), F.linear(xr, at.weight, at.bias))
    size_limit(20, allow_64bit=True)
    assert_matches(past(x), F.linear(x, past.weight, past.bias))


SIZE_GOOD = {
    "rows": lambda d: torch.randn(21, 8, device=d),
    "rows-3d": lambda d: torch.randn(3, 7, 8, device=d),
    "rows-many-pieces": lambda d: torch.randn(65, 8, device=d),
    "rows-transposed": lambda d: torch.randn(8, 45, device=d).t(),
    "slice-ld": lambda d: torch.randn(5, 21, device=d)[:, :8],
    "expanded-rows": lambda d: torch.randn(1, 8, device=d).expand(30, 8),
}


@pytest.mark.parametrize("name", list(SIZE_GOOD))
def test_beyond_the_limit_with_the_64bit_api(device: str, size_limit, name: str) -> None:
    """The limit lowered to 20 with the 64-bit API available (every cuBLAS >= 12): whatever
    exceeds it -- rows (split), leading dims, in/out features (the _64 calls) -- gives
    F.linear's output and gradients, also for the gradient of y.sum() (an expanded grad)."""
    size_limit(20, allow_64bit=True)
    for fin, fout in ((8, 4), (8, 21)):
        safe = cg.SafeLinear(fin, fout, device=device, name=NAME)
        x = SIZE_GOOD[name](device).detach().requires_grad_(True)
        x_ref = x.detach().clone().requires_grad_(True)
        y, ref = safe(x), F.linear(x_ref, safe.weight, safe.bias)
        assert_matches(y, ref)
        for grad in (torch.randn_like(y), torch.ones(1, device=device).expand_as(y)):
            got = torch.autograd.grad(y, [x, safe.weight, safe.bias], grad, retain_graph=True)
            want = torch.autograd.grad(ref, [x_ref, safe.weight, safe.bias], grad, retain_graph=True)
            for g, w in zip(got, want):
                assert_matches(g, w)


@pytest.mark.parametrize("grad", ["expanded", "transposed"])
def test_backward_splits_like_forward_without_the_64bit_api(device: str, size_limit, grad: str) -> None:
    safe = make_layer(device)
    x = torch.randn(21, 8, device=device, requires_grad=True)
    size_limit(20, allow_64bit=False)
    y = safe(x)  # forward: n = 21 split into 20 + 1
    g = (
        torch.ones(1, 4, device=device).expand(21, 4)
        if grad == "expanded"
        else torch.randn(4, 21, device=device).t()
    )
    got = torch.autograd.grad(y, [x, safe.weight], g)
    want = torch.autograd.grad(F.linear(x, safe.weight, safe.bias), [x, safe.weight], g)
    for a, b in zip(got, want):
        assert_matches(a, b)
