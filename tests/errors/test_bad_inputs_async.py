"""Bad inputs in async and off modes, beyond-the-limit strides, non-tensor and sparse inputs
(the rest of the bad-input matrix, tests/errors/test_bad_inputs.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg

from helpers import assert_matches
from helpers.inputs import INF, NAME, NAN, Snapshot, make_layer, randn_with, still_works


# --------------------------------------------------------------------------
# Async mode: the poisoned call returns, the next guarded call raises
# --------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["input", "weight", "bias"])
def test_async_bad_value_is_raised_by_the_next_call(device: str, where: str) -> None:
    safe = make_layer(device, mode="async")
    other = cg.SafeLinear(8, 2, device=device, name="other", mode="async")
    x = torch.randn(3, 8, device=device)
    target = {"input": x, "weight": safe.weight, "bias": safe.bias}[where]
    with torch.no_grad():
        target.view(-1)[2] = NAN
    before = Snapshot.of(x)
    y = safe(x)  # no raise: async mode records it
    assert y.shape == (3, 4)
    if device == "cuda":
        torch.cuda.synchronize()  # the device writes the record whenever the scan finishes
    with pytest.raises(cg.NonFiniteInputError) as info:
        other(torch.randn(2, 8, device=device))  # any guarded layer reports it
    err = info.value
    assert err.layer == NAME and err.role == where and err.deferred is True
    assert err.nan_count == 1 and err.first_bad_index == 2
    assert "recorded asynchronously" in str(err) and f"layer '{NAME}', call " in str(err)
    before.assert_same(x)
    cg.check()  # reported once: the record is clear now
    if where != "input":
        with torch.no_grad():
            target.view(-1)[2] = 0.25
    still_works(safe)
    cg.check()


def test_async_keeps_only_the_first_bad_call(device: str) -> None:
    safe = make_layer(device, mode="async")
    first = randn_with((2, 8), device, {(0, 1): INF})
    second = randn_with((2, 8), device, {(1, 7): NAN})
    safe.forward(first)
    if device == "cuda":
        torch.cuda.synchronize()  # the device writes the record whenever the scan finishes
    # The second call raises the first call's finding before it scans anything.
    with pytest.raises(cg.NonFiniteInputError) as info:
        safe(second)
    assert info.value.posinf_count == 1 and info.value.first_bad_index == 1
    cg.check()


def test_async_report_of_a_many_dim_input_names_its_shape(device: str) -> None:
    safe = cg.SafeLinear(3, 2, device=device, name=NAME, mode="async")
    x = torch.randn([2] * 9 + [3], device=device)
    x[(1,) * 9 + (2,)] = NAN
    safe(x)
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    err = info.value
    assert err.first_bad_index == x.numel() - 1  # this part is right already
    assert "shape ?" not in str(err)
    assert err.fields.get("shape") == [2] * 9 + [3] and err.fields.get("first_bad_coords") == [1] * 9 + [2]


def test_async_report_beyond_the_recorded_dims_says_so(device: str) -> None:
    """The async record keeps 16 dims; a 17-d input is reported without its shape, saying so."""
    safe = cg.SafeLinear(3, 2, device=device, name=NAME, mode="async")
    x = torch.randn([1] * 16 + [3], device=device)
    x[(0,) * 16 + (1,)] = NAN
    safe(x)
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert info.value.first_bad_index == 1
    assert "17-d tensor (shape not recorded), 3 elements" in str(info.value)


def test_async_bad_shape_still_raises_at_once(device: str) -> None:
    """Only the value scan is deferred: host-side checks raise in the call itself."""
    safe = make_layer(device, mode="async")
    with pytest.raises(cg.ShapeMismatchError):
        safe(torch.randn(2, 7, device=device))
    with pytest.raises(cg.DTypeError):
        safe(torch.randn(2, 8, device=device).double())
    with pytest.raises(cg.DTypeError):
        safe(torch.ones(2, 8, device=device, dtype=torch.int64))
    still_works(safe)
    cg.check()


def test_mode_off_passes_values_through(device: str) -> None:
    """mode='off' skips the value scan (NaN out, like nn.Linear) but keeps the other checks."""
    safe = make_layer(device, mode="off")
    x = randn_with((3, 8), device, {(1, 2): NAN})
    y = safe(x)
    ref = F.linear(x, safe.weight, safe.bias)
    assert torch.equal(y.isnan(), ref.isnan()) and y[1].isnan().all()
    assert_matches(y[[0, 2]], ref[[0, 2]])
    with pytest.raises(cg.ShapeMismatchError):
        safe(torch.randn(3, 9, device=device))


@pytest.mark.parametrize(
    "make_x",
    [
        lambda d: torch.randn(5, 21, device=d)[:, :8],  # a slice of a wide tensor: row stride 21
        lambda d: torch.randn(8, 21, device=d).t(),
    ],  # column-major: column stride 21
    ids=["slice-of-wide", "transposed"],
)
def test_strides_beyond_the_limit_are_copied_into_a_layout_that_fits(device: str, size_limit, make_x) -> None:
    """Without the 64-bit API, a stride beyond the limit (which would be a leading
    dimension) is not refused: the operand is copied once into the layout that fits."""
    safe = make_layer(device)
    x = make_x(device)
    before = Snapshot.of(x)
    size_limit(20, allow_64bit=False)
    assert_matches(safe(x), F.linear(x, safe.weight, safe.bias))
    before.assert_same(x)


def test_size_limit_in_backward(device: str, size_limit) -> None:
    """The backward GEMMs are checked too: a limit broken only there raises there (m of
    grad_input is in_features = 8 > 7, which cannot be split)."""
    safe = make_layer(device)
    x = torch.randn(12, 8, device=device, requires_grad=True)
    y = safe(x)
    size_limit(7, allow_64bit=False)  # the forward is done; its m = 4 would fit, its lda = 8 not
    with pytest.raises(cg.SizeLimitError) as info:
        y.backward(torch.randn_like(y))
    assert info.value.purpose in ("grad_input", "grad_weight")
    assert info.value.argument in ("m", "lda", "ldb", "ldc") and info.value.value == 8
    assert x.grad is None and safe.weight.grad is None
    size_limit(2**31 - 1)
    still_works(safe)


def test_non_tensor_input_is_a_type_error() -> None:
    safe = make_layer("cpu")
    for bad in ([1.0] * 8, None, 3.0):
        with pytest.raises(TypeError, match="must be a torch.Tensor"):
            safe(bad)  # type: ignore[arg-type]
    still_works(safe)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_input_works_like_nn_linear(layout: str) -> None:
    """nn.Linear accepts sparse COO and CSR input and returns a dense output: so must we."""
    safe = make_layer("cpu")
    dense = torch.randn(3, 8)
    x = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    ref = nn.Linear(8, safe.out_features)
    ref.load_state_dict(safe.state_dict())
    expected = ref(x)
    y = safe(x)
    assert y.layout == expected.layout == torch.strided
    assert_matches(y, expected)
    bad = dense.clone()
    bad[2, 5] = float("nan")
    with pytest.raises(cg.NonFiniteInputError):
        safe(bad.to_sparse() if layout == "coo" else bad.to_sparse_csr())
