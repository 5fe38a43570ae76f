"""SafeLinear's outputs and gradients against nn.Linear and a float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg

from helpers import SGEMM, assert_matches, gemm_spans, max_rel_error

SHAPES = {
    "1d": (13,),
    "2d": (9, 13),
    "3d": (4, 5, 13),
    "4d": (2, 3, 4, 13),
}


def pair(in_features: int, out_features: int, bias: bool, device: str) -> tuple[nn.Linear, cg.SafeLinear]:
    ref = nn.Linear(in_features, out_features, bias=bias, device=device)
    safe = cg.SafeLinear(in_features, out_features, bias=bias, device=device)
    safe.load_state_dict(ref.state_dict())
    return ref, safe


def check_against_reference(ref: nn.Linear, safe: cg.SafeLinear, x: torch.Tensor) -> None:
    """Outputs and all gradients: within 1e-5 of nn.Linear, and no further from the
    float64 truth than 2x nn.Linear's own error (plus float32 rounding)."""
    x_ref = x.detach().clone().requires_grad_(True)
    x_safe = x.detach().clone().requires_grad_(True)
    y_ref = ref(x_ref)
    y_safe = safe(x_safe)
    assert_matches(y_safe, y_ref)

    grad_out = torch.randn_like(y_ref)
    y_ref.backward(grad_out)
    y_safe.backward(grad_out)
    assert_matches(x_safe.grad, x_ref.grad)
    assert_matches(safe.weight.grad, ref.weight.grad)
    if ref.bias is not None:
        assert_matches(safe.bias.grad, ref.bias.grad)

    # float64 truth
    w64 = ref.weight.detach().double()
    b64 = ref.bias.detach().double() if ref.bias is not None else None
    y64 = F.linear(x.detach().double(), w64, b64)
    eps = 4 * torch.finfo(torch.float32).eps
    assert max_rel_error(y_safe, y64) <= 2 * max_rel_error(y_ref, y64) + eps


@pytest.mark.parametrize("rank", list(SHAPES))
@pytest.mark.parametrize("bias", [True, False])
def test_matches_nn_linear(device: str, rank: str, bias: bool) -> None:
    ref, safe = pair(13, 7, bias, device)
    check_against_reference(ref, safe, torch.randn(SHAPES[rank], device=device))


@pytest.mark.parametrize("bias", [True, False])
def test_transposed_and_strided_inputs(device: str, bias: bool) -> None:
    ref, safe = pair(13, 7, bias, device)
    base = torch.randn(13, 9, device=device)
    check_against_reference(ref, safe, base.t())  # column-major: cuBLAS reads it with op T
    wide = torch.randn(9, 40, device=device)
    check_against_reference(ref, safe, wide[:, 3:16])  # row stride 40: ld = 40, no copy
    check_against_reference(ref, safe, wide[:, ::3][:, :13])  # doubly strided: one copy
    check_against_reference(ref, safe, torch.randn(1, 13, device=device).expand(9, 13))  # stride 0
    check_against_reference(ref, safe, torch.randn(4, 13, 6, device=device).transpose(1, 2))


def test_non_contiguous_weight(device: str) -> None:
    """A weight that is itself a transposed view (e.g. tied to another layer's)."""
    ref, safe = pair(13, 7, True, device)
    shared = torch.randn(13, 7, device=device)
    with torch.no_grad():
        ref.weight = nn.Parameter(shared.t())
        safe.weight = nn.Parameter(shared.t())
    assert not safe.weight.is_contiguous()
    check_against_reference(ref, safe, torch.randn(5, 13, device=device))


@pytest.mark.parametrize(
    "shape,in_features",
    [((0, 13), 13), ((3, 0, 13), 13), ((3, 0), 0), ((0, 0), 0)],
    ids=["batch0", "middle0", "in_features0", "both0"],
)
def test_zero_sizes(device: str, shape: tuple[int, ...], in_features: int) -> None:
    """Zero-size dims give what nn.Linear gives (in_features 0: the bias) and never reach cuBLAS."""
    ref, safe = pair(in_features, 7, True, device)
    check_against_reference(ref, safe, torch.randn(shape, device=device))


def test_zero_out_features(device: str) -> None:
    ref, safe = pair(13, 0, True, device)
    x = torch.randn(4, 13, device=device, requires_grad=True)
    y = safe(x)
    assert y.shape == (4, 0)
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (1, 257, 3), (300, 1, 5), (64, 128, 96), (33, 517, 65)])
def test_sizes(device: str, m: int, k: int, n: int) -> None:
    ref, safe = pair(k, n, True, device)
    check_against_reference(ref, safe, torch.randn(m, k, device=device))


@pytest.mark.parametrize("shape", [(1, 13), (5, 13), (2, 3, 13)])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_gradients_of_a_reduced_loss(device: str, shape: tuple[int, ...], reduce: str) -> None:
    """loss = out.sum() / out.mean(): the gradient arrives broadcast (zero strides), and
    both gradient GEMMs read it (copied once for the two); the gradients are nn.Linear's."""
    ref, safe = pair(13, 7, True, device)
    x = torch.randn(shape, device=device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    getattr(safe(x), reduce)().backward()
    getattr(ref(x_ref), reduce)().backward()
    assert_matches(x.grad, x_ref.grad)
    assert_matches(safe.weight.grad, ref.weight.grad)
    assert_matches(safe.bias.grad, ref.bias.grad)


def test_only_some_inputs_need_grad(device: str) -> None:
    ref, safe = pair(13, 7, True, device)
    safe.weight.requires_grad_(False)
    x = torch.randn(5, 13, device=device, requires_grad=True)
    safe(x).sum().backward()
    assert safe.weight.grad is None and safe.bias.grad is not None and x.grad is not None
    x2 = torch.randn(5, 13, device=device)  # input without grad: weight/bias grads only
    safe.weight.requires_grad_(True)
    safe(x2).sum().backward()
    assert safe.weight.grad is not None


def test_double_backward(device: str) -> None:
    """Gradient penalties (WGAN-GP) differentiate through the input gradient."""
    ref, safe = pair(13, 7, True, device)
    x = torch.randn(6, 13, device=device)
    grads = {}
    for name, layer in (("ref", ref), ("safe", safe)):
        xi = x.clone().requires_grad_(True)
        out = torch.tanh(layer(xi)).sum()
        (gx,) = torch.autograd.grad(out, xi, create_graph=True)
        penalty = (gx.norm(dim=1) - 1).pow(2).mean()
        penalty.backward()
        grads[name] = (layer.weight.grad.clone(), layer.bias.grad.clone())
    assert_matches(grads["safe"][0], grads["ref"][0], rel=1e-4)
    assert_matches(grads["safe"][1], grads["ref"][1], rel=1e-4)


def test_functional_linear_matches_f_linear(device: str) -> None:
    x = torch.randn(3, 4, 13, device=device)
    w = torch.randn(7, 13, device=device)
    b = torch.randn(7, device=device)
    assert_matches(cg.linear(x, w, b, layer="f"), F.linear(x, w, b))
    assert_matches(cg.linear(x, w, layer="f", mode="off"), F.linear(x, w))


def test_no_grad_and_inference_mode(device: str) -> None:
    ref, safe = pair(13, 7, True, device)
    x = torch.randn(4, 13, device=device)
    with torch.no_grad():
        assert_matches(safe(x), ref(x))
    with torch.inference_mode():
        xi = torch.randn(4, 13, device=device)
        assert_matches(safe(xi), ref(xi))


# --------------------------------------------------------------------------
# Beyond cuBLAS's 32-bit limit (lowered by a test hook so it runs on CPU):
# the batch is split (forward, grad_input) or accumulated in pieces
# (grad_weight); what cannot be split goes to the 64-bit API.
# --------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [13, 18, 6, 7])
def test_batch_beyond_the_limit_is_split(device: str, size_limit, rows: int) -> None:
    ref, safe = pair(5, 4, True, device)
    size_limit(6)  # m = out_features = 4, k = in_features = 5 fit; the batch does not
    check_against_reference(ref, safe, torch.randn(rows, 5, device=device))
    check_against_reference(ref, safe, torch.randn(rows, 5, device=device).t().contiguous().t())
    check_against_reference(ref, safe, torch.randn(3, rows, 5, device=device))


def test_unsplittable_dims_use_the_64bit_api(device: str, size_limit, inject_fault) -> None:
    ref, safe = pair(9, 8, True, device)
    size_limit(6)  # in_features 9 = k = lda, out_features 8 = m = ldc: only the 64-bit API fits
    check_against_reference(ref, safe, torch.randn(11, 9, device=device))
    inject_fault("gemm", 13)
    with pytest.raises(cg.CublasError) as info:
        safe(torch.randn(11, 9, device=device))
    assert info.value.api == SGEMM[device][1]
    assert "chunk" in info.value.fields and "n 0..6 of 11" in info.value.chunk


def test_split_pieces_are_reported(device: str, size_limit, inject_fault) -> None:
    _, safe = pair(5, 4, True, device)
    size_limit(6)
    x = torch.randn(13, 5, device=device)
    safe(x)
    inject_fault("gemm", 14)
    with pytest.raises(cg.CublasError) as info:
        safe(x)
    # The weight^T operand of a 4-row piece would span 20 elements > 6: m is split too, and
    # the batch to pieces whose input rows (5 apart) stay within 6 elements.
    assert info.value.api == SGEMM[device][0]
    assert info.value.chunk == "m 0..1 of 4, n 0..1 of 13, k 0..5 of 5"
    assert "m=1 n=1 k=5" in str(info.value)


# No 32-bit piece may have an operand spanning more than the limit in elements (some
# cuBLAS(Lt) releases failed once one spans >= 2^31 elements, every argument in range). The
# first piece is the largest, so its report bounds every piece. (in, out, rows, limit, pass)
SPAN_CASES = {
    "batch": (2, 3, 40, 20, "forward"),  # the >2^31-row GPU test, scaled down
    "batch-grad_weight": (2, 3, 40, 20, "backward"),
    "big-weight": (12, 10, 3, 40, "forward"),  # weight^T spans 120 elements: m is split
    "big-weight-backward": (12, 10, 3, 40, "backward"),
    "wide-input": (30, 2, 5, 40, "forward"),  # k = lda = 30: the batch goes 1 row a piece
}


@pytest.mark.parametrize("case", list(SPAN_CASES))
def test_no_piece_operand_spans_beyond_the_limit(device: str, size_limit, inject_fault, case: str) -> None:
    fin, fout, rows, limit, where = SPAN_CASES[case]
    ref, safe = pair(fin, fout, True, device)
    size_limit(limit)  # every argument fits: only the spans force the split
    check_against_reference(ref, safe, torch.randn(rows, fin, device=device))
    x = torch.randn(rows, fin, device=device, requires_grad=True)
    y = safe(x) if where == "backward" else None
    inject_fault("gemm", 13)
    with pytest.raises(cg.CublasError) as info:
        if y is None:
            safe(x)
        else:
            y.backward(torch.randn_like(y))
    spans = gemm_spans(info.value.fields)
    assert max(spans.values()) <= limit, (info.value.purpose, spans, info.value.chunk)
    assert info.value.api == SGEMM[device][0] and info.value.chunk


def test_a_broadcast_gradient_is_copied_once_for_both_gemms() -> None:
    """out.sum() hands the layer a zero-stride gradient; both gradient GEMMs get one dense copy
    of it (made once in backward) instead of each copying it for cuBLAS's layout."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[tuple[str, tuple[int, ...]]] = []

    class GradGemmArgs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (
                torch.ops.cublas_guard.linear_grad_input.default,
                torch.ops.cublas_guard.linear_grad_weight.default,
            ):
                seen.append((func.__name__, tuple(args[0].stride())))
            return func(*args, **(kwargs or {}))

    layer = cg.SafeLinear(13, 7, name="broadcast")
    x = torch.randn(5, 13, requires_grad=True)
    out = layer(x).sum()
    with GradGemmArgs():
        out.backward()
    assert sorted(name for name, _ in seen) == ["linear_grad_input.default", "linear_grad_weight.default"]
    assert all(0 not in strides for _, strides in seen), seen
