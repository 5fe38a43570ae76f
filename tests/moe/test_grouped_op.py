"""The guarded grouped GEMM (``torch.ops.cublas_guard.grouped_linear``) against F.linear per group:
every dtype, both weight layouts, biases, experts no row went to, rows past the last group end,
gradients (first and second order), autocast, torch.compile, the clean-parameter cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cublas_guard_ext as cg
from cublas_guard_ext.models.experts import grouped_linear

from helpers.moe_models import grouped_reference

TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def operands(dtype=torch.float32, transposed=False, bias=True, ends=(3, 3, 8, 8), rows=11, device="cpu"):
    """x [rows, 6] sorted by expert, weights for len(ends) experts (5 outputs), int32 ends: by
    default an empty expert (1), an empty last one (3) and 3 rows past the last end."""
    experts = len(ends)
    shape = (experts, 6, 5) if transposed else (experts, 5, 6)
    x = torch.randn(rows, 6, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    b = torch.randn(experts, 5, dtype=dtype, device=device, requires_grad=True) if bias else None
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    return x, w, b, offs


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["linear_layout", "transposed"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_forward_and_gradients_match_f_linear_per_group(device, dtype, transposed, bias) -> None:
    x, w, b, offs = operands(dtype, transposed, bias, device=device)
    out = grouped_linear(x, w, offs, b, layer="m.experts", parameter="gate_up_proj", transposed=transposed)
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref_b = b.detach().clone().requires_grad_() if bias else None
    ref = grouped_reference(ref_x, ref_w, offs, ref_b, transposed)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert torch.equal(out[8:], torch.zeros_like(out[8:]))  # past the last end: zeros
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, ref_x.grad, **TOL[dtype])
    torch.testing.assert_close(w.grad, ref_w.grad, **TOL[dtype])
    assert torch.equal(x.grad[8:], torch.zeros_like(x.grad[8:]))  # rows no expert owns
    for empty in (1, 3):  # no row went to these experts: zero, not uninitialized
        assert torch.equal(w.grad[empty], torch.zeros_like(w.grad[empty]))
    if bias:
        torch.testing.assert_close(b.grad, ref_b.grad, **TOL[dtype])
        assert torch.equal(b.grad[1], torch.zeros_like(b.grad[1]))


def test_float32_on_the_cpu_is_bitwise_f_linear_per_group() -> None:
    x, w, b, offs = operands(torch.float32)
    out = grouped_linear(x, w, offs, layer="e", parameter="down_proj")
    assert torch.equal(out, grouped_reference(x, w, offs))


def test_the_transposed_layout_is_bitwise_torch_grouped_mm_on_the_cpu() -> None:
    """transformers' grouped_mm route for gpt-oss's [experts, in, out] weights, bias added after."""
    x, w, b = torch.randn(11, 8), torch.randn(4, 8, 4), torch.randn(4, 4)  # rows of 16-byte multiples
    offs = torch.tensor([3, 3, 8, 11], dtype=torch.int32)
    rows_of = torch.repeat_interleave(torch.arange(4), torch.tensor([3, 0, 5, 3]))
    ref = F.grouped_mm(x, w, offs=offs) + b[rows_of]
    assert torch.equal(grouped_linear(x, w, offs, b, transposed=True), ref)


def test_no_rows_and_no_experts_with_rows() -> None:
    x, w, b, offs = operands(rows=0, ends=(0, 0, 0, 0))
    assert grouped_linear(x, w, offs, b).shape == (0, 5)
    x, w, b, offs = operands(rows=4, ends=(0, 0, 0, 0))
    out = grouped_linear(x, w, offs, b)
    assert torch.equal(out, torch.zeros(4, 5))
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_int64_offsets_are_taken() -> None:
    x, w, b, offs = operands()
    torch.testing.assert_close(grouped_linear(x, w, offs.long(), b), grouped_linear(x, w, offs, b))


def test_second_order_gradients_float64() -> None:
    for transposed in (False, True):
        x, w, b, offs = operands(torch.float64, transposed, rows=9, ends=(2, 2, 6, 7))

        def fn(x, w, b, transposed=transposed, offs=offs):
            return grouped_linear(x, w, offs, b, mode="off", transposed=transposed)

        assert torch.autograd.gradcheck(fn, (x, w, b))
        assert torch.autograd.gradgradcheck(fn, (x, w, b))


def test_autocast_casts_like_f_linear() -> None:
    x, w, b, offs = operands(torch.float32, bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_linear(x, w, offs, b)
        ref = grouped_reference(x, w, offs, b)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])
    out.float().sum().backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


@pytest.mark.locked  # the parameter cache is the locked library's
def test_the_weights_are_scanned_again_only_when_they_change() -> None:
    """The clean-parameter cache: a write through .data (no version bump) is not seen; an
    in-place write under no_grad (a version bump, as an optimizer step makes) is."""
    x, w, _, offs = operands(bias=False)
    weight = torch.nn.Parameter(w.detach().clone())
    grouped_linear(x, weight, offs, layer="e", parameter="gate_up_proj")  # scanned clean
    weight.data[2, 0, 0] = float("nan")  # invisible to the cache: not scanned again
    out = grouped_linear(x, weight, offs, layer="e", parameter="gate_up_proj")
    assert out[3:8].isnan().any()
    with torch.no_grad():
        weight[2, 0, 1] = 1.0  # a tracked write: scanned again, the NaN is found
    with pytest.raises(cg.NonFiniteInputError) as info:
        grouped_linear(x, weight, offs, layer="e", parameter="gate_up_proj")
    assert info.value.expert == 2 and info.value.role == "weight"


def test_only_the_routed_rows_are_scanned() -> None:
    """Rows past the last group end belong to no expert (grouped_mm leaves them uninitialized,
    expert-parallel sentinels land there): a NaN there is not refused, and not propagated."""
    x, w, b, offs = operands()
    with torch.no_grad():
        x[9, 2] = float("nan")
    out = grouped_linear(x, w, offs, b)
    assert torch.equal(out[8:], torch.zeros(3, 5))


def test_async_mode_records_and_the_next_check_raises() -> None:
    x, w, b, offs = operands()
    with torch.no_grad():
        x[4, 1] = float("inf")
    grouped_linear(x, w, offs, b, layer="model.layers.0.mlp.experts", parameter="down_proj", mode="async")
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    err = info.value
    assert err.layer == "model.layers.0.mlp.experts.down_proj" and err.deferred
    assert err.role == "input" and err.first_bad_coords == [4, 1]


def test_off_mode_scans_nothing() -> None:
    x, w, b, offs = operands()
    with torch.no_grad():
        x[4, 1] = float("nan")
    out = grouped_linear(x, w, offs, b, mode="off")
    assert out[4].isnan().all() and not out[:3].isnan().any()


@pytest.mark.slow
def test_torch_compile_traces_the_op_with_its_gradients() -> None:
    x, w, b, offs = operands()

    def fn(x, w, b, offs):
        return grouped_linear(x, w, offs, b, layer="e", parameter="gate_up_proj").square().sum()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    loss = compiled(x, w, b, offs)
    grads = torch.autograd.grad(loss, (x, w, b))
    eager = torch.autograd.grad(fn(x, w, b, offs), (x, w, b))
    for got, want in zip(grads, eager):
        torch.testing.assert_close(got, want)
    with torch.no_grad():
        w[1, 0, 0] = float("nan")  # an empty expert: nothing reads it, but the weight is scanned
    with pytest.raises(cg.NonFiniteInputError, match=r"gate_up_proj\[1\]"):
        compiled(x, w, b, offs)
