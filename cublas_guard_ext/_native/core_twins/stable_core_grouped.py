"""The grouped linear's Python side under the stable core alone: csrc/locked/moe/grouped_autograd.cpp's
Autograd and Autocast kernels and ops_meta.cpp's Meta kernels, for the three grouped ops, as
stable_core.py does them for the linear op (its helpers: one kernel shape, typed errors)."""

from __future__ import annotations

from typing import Any

import torch

from ..loading import codes as _codes
from . import stable_core as _core

_ops = torch.ops.cublas_guard


def _bias_grad(grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per expert, the sum of grad's rows of that expert, matched on the device (rows past
    the last end go to a dropped extra row: no host synchronization); half precision sums
    accumulate in float32 (grouped_autograd.cpp's grouped_bias_grad)."""
    acc = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    rows = torch.arange(grad.shape[0], device=offs.device, dtype=offs.dtype)
    expert = torch.searchsorted(offs, rows, right=True)
    sums = torch.zeros((offs.shape[0] + 1, grad.shape[1]), dtype=acc, device=grad.device)
    sums.index_put_((expert,), grad.to(acc), accumulate=True)
    return sums[: offs.shape[0]].to(grad.dtype)


class _Grouped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, keyset, x, weight, bias, offs, layer, parameter, mode, transposed):  # noqa: ANN001, ANN205
        ctx.save_for_backward(
            _core._saved_if(weight.requires_grad, x), _core._saved_if(x.requires_grad, weight), offs
        )
        ctx.names, ctx.has_bias = (layer, parameter, transposed), bias is not None
        op = _ops.grouped_linear.default
        return _core._below_autograd(op, keyset, x, weight, bias, offs, layer, parameter, mode, transposed)

    @staticmethod
    @_core.typed_errors
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, weight, offs = ctx.saved_tensors
        grad = grad.contiguous()  # a broadcast gradient: one copy for every expert's GEMM
        gx = (
            _ops.grouped_linear_grad_input.default(grad, weight, offs, *ctx.names)
            if ctx.needs_input_grad[1]
            else None
        )
        gw = (
            _ops.grouped_linear_grad_weight.default(grad, x, offs, *ctx.names)
            if ctx.needs_input_grad[2]
            else None
        )
        gb = _bias_grad(grad, offs) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return None, gx, gw, gb, None, None, None, None, None


class _GroupedGradInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, keyset, grad_output, weight, offs, layer, parameter, transposed):  # noqa: ANN001, ANN205
        ctx.save_for_backward(
            _core._saved_if(weight.requires_grad, grad_output),
            _core._saved_if(grad_output.requires_grad, weight),
            offs,
        )
        ctx.names = (layer, parameter, transposed)
        op = _ops.grouped_linear_grad_input.default
        return _core._below_autograd(op, keyset, grad_output, weight, offs, layer, parameter, transposed)

    @staticmethod
    @_core.typed_errors
    def backward(ctx, dgi):  # noqa: ANN001, ANN205
        g, weight, offs = ctx.saved_tensors
        layer, parameter, transposed = ctx.names
        dgi = dgi.contiguous()
        off = _codes.MODE_OFF
        dg = (
            _ops.grouped_linear.default(dgi, weight, None, offs, layer, parameter, off, transposed)
            if ctx.needs_input_grad[1]
            else None
        )
        dw = (
            _ops.grouped_linear_grad_weight.default(g, dgi, offs, *ctx.names)
            if ctx.needs_input_grad[2]
            else None
        )
        return None, dg, dw, None, None, None, None


class _GroupedGradWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, keyset, grad_output, x, offs, layer, parameter, transposed):  # noqa: ANN001, ANN205
        ctx.save_for_backward(
            _core._saved_if(x.requires_grad, grad_output), _core._saved_if(grad_output.requires_grad, x), offs
        )
        ctx.names = (layer, parameter, transposed)
        op = _ops.grouped_linear_grad_weight.default
        return _core._below_autograd(op, keyset, grad_output, x, offs, layer, parameter, transposed)

    @staticmethod
    @_core.typed_errors
    def backward(ctx, dgw):  # noqa: ANN001, ANN205
        g, x, offs = ctx.saved_tensors
        layer, parameter, transposed = ctx.names
        dgw = dgw.contiguous()
        off = _codes.MODE_OFF
        dg = (
            _ops.grouped_linear.default(x, dgw, None, offs, layer, parameter, off, transposed)
            if ctx.needs_input_grad[1]
            else None
        )
        dx = (
            _ops.grouped_linear_grad_input.default(g, dgw, offs, *ctx.names)
            if ctx.needs_input_grad[2]
            else None
        )
        return None, dg, dx, None, None, None, None


# ---------------------------------------------------------------------------
# Fake kernels: shapes, and the C++ rules on the traced example's sizes (stable_core.stand_ins)
# ---------------------------------------------------------------------------
@_core.typed_errors
def _rules(
    op: str, a: Any, b: Any, bias: Any, offs: Any, layer: str, parameter: str, mode: int, transposed: bool
):
    concrete = _core.stand_ins(a, b, bias, offs)
    if concrete is not None:
        torch.ops.cublas_guard_internal.grouped_argument_rules.default(
            op, *concrete, layer, parameter, mode, transposed
        )


def _fake_grouped(x, weight, bias, offs, layer="", parameter="", mode=_codes.MODE_SYNC, transposed=False):  # noqa: ANN001, ANN202
    _rules("grouped_linear", x, weight, bias, offs, layer, parameter, mode, transposed)
    return x.new_empty((x.shape[0], weight.shape[2 if transposed else 1]), dtype=weight.dtype)


def _fake_grad_input(grad_output, weight, offs, layer="", parameter="", transposed=False):  # noqa: ANN001, ANN202
    _rules("grouped_linear_grad_input", grad_output, weight, None, offs, layer, parameter, 0, transposed)
    return grad_output.new_empty(
        (grad_output.shape[0], weight.shape[1 if transposed else 2]), dtype=weight.dtype
    )


def _fake_grad_weight(grad_output, x, offs, layer="", parameter="", transposed=False):  # noqa: ANN001, ANN202
    _rules("grouped_linear_grad_weight", grad_output, x, None, offs, layer, parameter, 0, transposed)
    out, inp = grad_output.shape[1], x.shape[1]
    return x.new_empty((offs.shape[0], inp, out) if transposed else (offs.shape[0], out, inp), dtype=x.dtype)


def register(library: torch.library.Library) -> None:
    """The grouped ops' Autograd, Autocast and fake kernels (the loader calls it after stable_core.register)."""
    torch.library.register_fake("cublas_guard::grouped_linear", _fake_grouped)
    torch.library.register_fake("cublas_guard::grouped_linear_grad_input", _fake_grad_input)
    torch.library.register_fake("cublas_guard::grouped_linear_grad_weight", _fake_grad_weight)
    for name, function, defaults in (
        ("grouped_linear", _Grouped, ("", "", _codes.MODE_SYNC, False)),
        ("grouped_linear_grad_input", _GroupedGradInput, ("", "", False)),
        ("grouped_linear_grad_weight", _GroupedGradWeight, ("", "", False)),
    ):
        op = getattr(_ops, name).default
        library.impl(name, _core._autograd_kernel(op, function, defaults), "Autograd", with_keyset=True)
    for device_type in ("cpu", "cuda"):
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        library.impl(
            "grouped_linear", _core._autocast_kernel(device_type, _ops.grouped_linear.default, (0, 1, 2)), key
        )
