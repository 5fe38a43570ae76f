"""watch: ops that only move values carry a NaN on without being blamed; narrowing casts that
overflow are blamed."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import cublas_guard_ext as cg

watch_module = importlib.import_module("cublas_guard_ext.watching.session")


# Each op below moves values (or writes 0/1 or a finite scalar): with a non-finite input it is a
# propagator, never blamed; narrowing casts and arithmetic that overflow are blamed.

_NAN_ROW = 1  # the row of the planted NaN


def _planted_nan(x: torch.Tensor) -> torch.Tensor:
    """x with NaN in one row, made by an allowed producer (log of a negative) inside the block."""
    sign = torch.ones_like(x)
    sign[_NAN_ROW] = -1.0
    return torch.log(sign * x.abs() + sign * 0.5)  # log(-(|x| + 0.5)) = NaN in that row


_MASK = torch.tensor([[True, False, False, True]]).expand(4, 4).contiguous()
_IDX = torch.tensor([1, 0, 3])
_TWO = torch.tensor(2.0)  # made before the block: one element, read rather than looked up

_MOVES = {
    "clone": lambda x: x.clone(),
    "contiguous": lambda x: x.t().contiguous(),
    "copy_": lambda x: torch.zeros(4, 4).copy_(x),
    "to_float64": lambda x: x.to(torch.float64),
    "_unsafe_view": lambda x: torch.ops.aten._unsafe_view(x, [16]),
    "expand_copy": lambda x: torch.ops.aten.expand_copy(x[_NAN_ROW : _NAN_ROW + 1], [3, 4]),
    "permute_copy": lambda x: torch.ops.aten.permute_copy(x, [1, 0]),
    "repeat": lambda x: x.repeat(2, 1),
    "roll": lambda x: x.roll(1, 0),
    "flip": lambda x: x.flip(0),
    "cat": lambda x: torch.cat([x, torch.ones(1, 4)]),
    "stack": lambda x: torch.stack([x, torch.ones(4, 4)]),
    "index_select": lambda x: x.index_select(0, _IDX),
    "gather": lambda x: x.gather(0, torch.tensor([[1, 1, 1, 1]])),
    "take": lambda x: x.take(torch.tensor([4, 5])),
    "index": lambda x: x[_IDX],
    "embedding": lambda x: F.embedding(torch.tensor([1, 2]), x),
    "masked_select": lambda x: x.masked_select(_MASK),
    "masked_scatter_": lambda x: torch.zeros(4, 4).masked_scatter_(~_MASK, x),
    "slice_backward": lambda x: torch.ops.aten.slice_backward(x, [6, 4], 0, 1, 5, 1),
    "select_backward": lambda x: torch.ops.aten.select_backward(x[1], [4, 4], 0, 2),
    "tril": lambda x: x.tril(),
    "triu_": lambda x: x.clone().triu_(),
    "constant_pad_nd": lambda x: F.pad(x, (1, 1), value=2.0),
    "where": lambda x: torch.where(_MASK, x, torch.zeros(4, 4)),
    "where_scalar": lambda x: torch.where(_MASK, x, 0.0),
    "masked_fill_scalar": lambda x: x.clone().masked_fill_(_MASK, -1.0e30),
    "masked_fill_tensor": lambda x: x.clone().masked_fill_(_MASK, _TWO),
    "masked_fill_": lambda x: x.clone().masked_fill_(_MASK, 3.0),
    "relu": lambda x: torch.relu(x),
    "clamp": lambda x: x.clamp(-1.0, 1.0),
    "neg": lambda x: -x,
    "abs": lambda x: x.abs(),
    "neg_": lambda x: x.clone().neg_(),
    "abs_": lambda x: x.clone().abs_(),
    "relu_": lambda x: x.clone().relu_(),
    "clamp_": lambda x: x.clone().clamp_(-1.0, 1.0),
    "clamp_min": lambda x: x.clamp_min(0.0),
    "clamp_max_": lambda x: x.clone().clamp_max_(1.0),
    "tril_": lambda x: x.clone().tril_(),
    "where_scalar_self": lambda x: torch.where(_MASK, 0.0, x),
    "masked_fill": lambda x: x.masked_fill(_MASK, 3.0),
    "masked_scatter": lambda x: torch.zeros(4, 4).masked_scatter(~_MASK, x),
    "lift_fresh_copy": lambda x: torch.ops.aten.lift_fresh_copy(x),
    "transpose_copy": lambda x: torch.ops.aten.transpose_copy(x, 0, 1),
    "t_copy": lambda x: torch.ops.aten.t_copy(x),
    "squeeze_copy": lambda x: torch.ops.aten.squeeze_copy(x.unsqueeze(0)),
    "unsqueeze_copy": lambda x: torch.ops.aten.unsqueeze_copy(x, 0),
    "slice_copy": lambda x: torch.ops.aten.slice_copy(x, 0, 1, 3),
    "select_copy": lambda x: torch.ops.aten.select_copy(x, 0, _NAN_ROW),
    "diagonal_copy": lambda x: torch.ops.aten.diagonal_copy(x),
    "as_strided_copy": lambda x: torch.ops.aten.as_strided_copy(x, [2, 4], [4, 1], 4),
    "alias_copy": lambda x: torch.ops.aten.alias_copy(x),
    "detach_copy": lambda x: torch.ops.aten.detach_copy(x),
    "view_copy": lambda x: torch.ops.aten.view_copy(x, [16]),
    "_reshape_copy": lambda x: torch.ops.aten._reshape_copy(x, [16]),
    "narrow_copy": lambda x: torch.ops.aten.narrow_copy(x, 0, 1, 2),
    "unfold_copy": lambda x: torch.ops.aten.unfold_copy(x, 0, 2, 1),
    "diagonal_backward": lambda x: torch.ops.aten.diagonal_backward(x.diagonal(), [4, 4], 0, 0, 1),
}


@pytest.mark.parametrize("name", sorted(_MOVES))
def test_moving_ops_are_never_blamed(name):
    fn = _MOVES[name]
    with cg.watch(None, mode="sync", allow=["aten.log"]):
        x = torch.rand(4, 4) * 1.5 + 0.5
        y = fn(x)
        assert torch.isfinite(y).all()
        bad = _planted_nan(x)
        y = fn(bad)  # a propagator: not blamed
        assert not torch.isfinite(y).all()
        y.mul_(3.0)  # NaN before the op: a propagator too
        z = fn(bad) * 1.0
    assert z.shape == fn(x).shape


def test_an_in_place_op_on_a_copy_of_values_from_before_the_block_is_not_blamed():
    outside = torch.tensor([1.0, float("nan"), 2.0])  # made before the block: untracked
    with cg.watch(None, mode="sync"):
        y = outside.clone()
        y.mul_(3.0)
    assert torch.isnan(y[1])


_TO_COPY = ("aten._to_copy.default", "aten.copy_.default")  # .to() copies in _to_copy's kernel


@pytest.mark.parametrize(
    "name,fn,ops",
    [
        ("fp32 -> fp16", lambda: torch.full((3,), 1e5).to(torch.float16), _TO_COPY),
        ("fp64 -> fp32", lambda: torch.full((3,), 1e300, dtype=torch.float64).float(), _TO_COPY),
        ("int32 -> fp16", lambda: torch.arange(65000, 70000, dtype=torch.int32).half(), _TO_COPY),
        ("one element fp32 -> fp16", lambda: torch.full((1,), 1e5).half(), _TO_COPY),
        (
            "copy_ fp32 -> bf16",
            lambda: torch.zeros(3, dtype=torch.bfloat16).copy_(torch.full((3,), 3.4e38)),
            ("aten.copy_.default",),
        ),
        (
            "cat fp32 into fp16 out=",
            lambda: torch.cat([torch.full((2,), 1e5)], out=torch.zeros(2, dtype=torch.float16)),
            ("aten.cat.out", "aten.copy_.default"),
        ),
        (
            "where fp16 from fp32",
            lambda: torch.where(
                torch.tensor([True, False]), torch.full((2,), 1e5), torch.zeros(2, dtype=torch.float16)
            ).half(),
            _TO_COPY,
        ),
    ],
)
def test_narrowing_moves_are_scanned_and_blamed(name, fn, ops):
    # (torch itself refuses a Scalar out of a dtype's range: fill_(1e5) on float16 raises)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            fn()
    assert info.value.op in ops and info.value.posinf_count + info.value.neginf_count > 0
