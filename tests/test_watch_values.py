"""watch: outputs finite by construction are not scanned, yet never taken for finite (issue 13)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import cublas_guard_ext as cg

watch_module = importlib.import_module("cublas_guard_ext.watch")


# -- outputs finite by construction: not scanned (issue 13, cost) ----------------------------
#
# csrc/watch.cpp's Values lists. Each op below moves values (or writes 0/1 or a
# finite scalar): its output is not scanned. A non-finite input must still
# make it a propagator (never blamed, and its output never remembered as
# finite); narrowing casts, out-of-range scalars and arithmetic that can
# overflow are still scanned and blamed.

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
# ops whose kernel writes in place again (into a copy; relu_ calls clamp_min_ on self): that op's
# pre-scan runs inside the kernel, where the table is not trusted (one scan); the output itself is
# not scanned
_MOVES_PRESCANS = {"masked_fill": 1, "masked_scatter": 1, "relu_": 1}


@pytest.mark.parametrize("name", sorted(_MOVES))
def test_moving_ops_are_not_scanned_and_never_blamed(name):
    fn = _MOVES[name]
    with cg.watch(None, mode="sync", allow=["aten.log"]) as w:
        x = torch.rand(4, 4) * 1.5 + 0.5  # scanned: known finite
        _, scanned, _ = w.stats()
        y = fn(x)
        _, scanned_after, _ = w.stats()
        assert scanned_after == scanned + _MOVES_PRESCANS.get(name, 0), f"{name}: the output was scanned"
        # known finite from its finite input: an in-place op on it needs no pre-scan
        assert watch_module._native.known_finite(y)
        bad = _planted_nan(x)
        y = fn(bad)  # a propagator: not blamed
        assert not torch.isfinite(y).all()
        assert not watch_module._native.known_finite(y)
        y.mul_(3.0)  # NaN before the op: a propagator too (pre-scanned, not taken as known)
        z = fn(bad) * 1.0
    assert z.shape == fn(x).shape


def test_moving_op_output_with_a_non_finite_input_is_not_taken_for_finite():
    # were clone's output remembered finite, mul_ would skip its pre-scan and be blamed
    outside = torch.tensor([1.0, float("nan"), 2.0])  # made before the block: unknown to it
    with cg.watch(None, mode="sync") as w:
        y = outside.clone()
        y.mul_(3.0)
        _, scanned, _ = w.stats()
    assert scanned == 2  # mul_'s pre-scan of y (NaN: a propagator) and its output


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


_FILLS = {
    "bernoulli_": lambda x: torch.empty(100).bernoulli_(0.3),
    "bernoulli": lambda x: torch.bernoulli(torch.full((100,), 0.5)),
    "zeros": lambda x: torch.zeros(100),
    "ones": lambda x: torch.ones(100),
    "full": lambda x: torch.full((100,), 7.0),
    "fill_": lambda x: x.clone().fill_(2.0),
    "fill_tensor": lambda x: x.clone().fill_(_TWO),
    "zero_": lambda x: x.clone().zero_(),
    "zeros_like": lambda x: torch.zeros_like(x),
    "ones_like": lambda x: torch.ones_like(x),
    "full_like": lambda x: torch.full_like(x, -3.0),
    "new_zeros": lambda x: x.new_zeros(100),
    "new_ones": lambda x: x.new_ones(100),
    "new_full": lambda x: x.new_full((100,), 5.0),
    "scalar_tensor": lambda x: torch.scalar_tensor(2.5),
}


@pytest.mark.parametrize("name", sorted(_FILLS))
def test_bernoulli_and_fills_are_not_scanned(name):
    with cg.watch(None, mode="sync") as w:
        x = torch.rand(100) * 2.0
        _, scanned, _ = w.stats()
        y = _FILLS[name](x)
        _, scanned_after, _ = w.stats()
        assert scanned_after == scanned
        assert watch_module._native.known_finite(y)  # known finite: in-place ops on it skip the pre-scan
    assert y.isfinite().all()


def test_scaling_by_at_most_one_is_not_scanned_and_scaling_up_is():
    with cg.watch(None, mode="sync") as w:
        x = torch.rand(100) * 3.0e38 + 1.0  # scanned: known finite
        _, scanned, _ = w.stats()
        y = x * 0.5
        y = 0.25 * y
        y = y / 3.0
        y.mul_(0.999)
        y.div_(-2.0)
        y = y + 1e-8
        y.sub_(1.0, alpha=2.0)
        _, scanned_after, _ = w.stats()
        assert scanned_after == scanned
        assert watch_module._native.known_finite(y)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.full((4,), 3.0e38) * 2.0
    assert info.value.op == "aten.mul.Tensor" and info.value.posinf_count == 4
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.full((4,), 3.0e38).div_(0.5)
    assert info.value.op == "aten.div_.Tensor"
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.full((4,), 1.0).div(0.0)
    assert info.value.op == "aten.div.Tensor"
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.full((4,), 3.0e38) + 1e38
    assert info.value.op == "aten.add.Tensor"
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.full((4,), 65504.0, dtype=torch.float16) + 16.0  # 65520 rounds to inf
    assert info.value.op == "aten.add.Tensor" and info.value.dtype == "torch.float16"
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="async"):
            x = torch.ones(4) * 1.5
            torch.add(x, 1e40, alpha=1e-30)  # alpha * other = 1e10, but 1e40 is inf as a float
    assert info.value.op in ("aten.copy_.default", "aten.add.Tensor") and info.value.posinf_count > 0


def test_scaling_an_unknown_input_is_scanned():
    outside = torch.tensor([1.0, float("nan")])
    with cg.watch(None, mode="sync") as w:
        outside * 0.5  # the input is not known finite: scanned (a propagator)
        _, scanned, _ = w.stats()
    assert scanned == 2  # the output, then the input to judge it


def test_composite_ops_reuse_their_inner_scans_at_any_depth():
    x, weight, bias = torch.randn(3, 8), torch.randn(4, 8), torch.randn(4)
    with cg.watch(None, mode="sync") as w:
        F.linear(x, weight, bias)  # composite (aten's Autograd kernel only redispatches): addmm's scan
        _, scanned, saved = w.stats()
    assert scanned == 1 and saved >= 1
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            F.linear(torch.full((2, 8), 1e30), torch.full((4, 8), 1e30))
    assert info.value.op == "aten.mm.default"


def test_known_table_grows_and_drops_freed_storages():
    with cg.watch(None, mode="sync"):
        keep = [torch.rand(3) * 1.5 for _ in range(6000)]  # more than the initial 4096 slots
        assert all(watch_module._native.known_finite(t) for t in keep)
        for i in range(0, 6000, 2):
            keep[i] = None  # freed: dropped at the next prune
        more = [torch.rand(3) * 1.5 for _ in range(6000)]
        assert all(watch_module._native.known_finite(t) for t in keep if t is not None)
        assert all(watch_module._native.known_finite(t) for t in more)
        for t in more[:100]:
            t.data.fill_(float("nan"))  # another version counter: the entry is forgotten
        assert not any(watch_module._native.known_finite(t) for t in more[:100])
        # erasing shifts the entries after them back: every other one is still found
        assert all(watch_module._native.known_finite(t) for t in more[100:])
        assert all(watch_module._native.known_finite(t) for t in keep if t is not None)
        for t in more[:100]:
            t.mul_(3.0)  # NaN before the op: a propagator, not blamed


def test_known_values_carry_to_the_next_block_until_written():
    x = torch.rand(100) + 0.5
    with cg.watch(None, mode="sync", allow=["aten.log"]):
        y = x * 3.0  # scanned: finite
        z = torch.log(x - 10.0)  # scanned: NaN (allowed here)
    with cg.watch(None, mode="sync") as w:
        # known from the last block, with its bounds: no pre-scan, and the output is bounded
        # by them (watch_bounds.cpp): no scan at all
        y.mul_(3.0)
        _, scanned, _ = w.stats()
    assert scanned == 0
    y.add_(1.0)  # a write outside any block bumps the version
    with cg.watch(None, mode="sync") as w:
        y.mul_(3.0)  # the pre-scan only (it gives the bounds)
        _, scanned, _ = w.stats()
    assert scanned == 1
    with cg.watch(None, mode="sync") as w:
        z.mul_(3.0)  # non-finite findings are not carried: pre-scanned, a propagator
        _, scanned, _ = w.stats()
    assert scanned == 2


def test_a_square_root_scaled_by_a_scalar_is_not_scanned_unless_it_can_overflow():
    # |sqrt(y)| <= 2**64 for any finite float32 y: AdamW's exp_avg_sq.sqrt() / bias_correction2_sqrt
    # (a divisor below 1) cannot overflow, so the division's output needs no scan
    with cg.watch(None, mode="sync") as w:
        v = torch.rand(100) * 3.0e38  # scanned: known finite
        r = v.sqrt()  # scanned: known finite, a square root
        _, scanned, _ = w.stats()
        d = r / 0.001
        e = r * 1000.0
        f = 1000.0 * r
        d.add_(1e-8)
        _, scanned_after, _ = w.stats()
        assert scanned_after == scanned
        assert all(watch_module._native.known_finite(t) for t in (d, e, f))
        # finite, not a square root, and large enough that scaling it up may overflow: scanned
        x = torch.rand(100) * 2.0 + 1.0e35
        _, scanned, _ = w.stats()
        x / 0.001
        _, scanned_after, _ = w.stats()
        assert scanned_after == scanned + 1
    assert torch.isfinite(d).all() and torch.isfinite(e).all()
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.full((4,), 3.0e38).sqrt() / 1e-30  # 1.7e19 / 1e-30 overflows: scanned, blamed
    assert info.value.op == "aten.div.Tensor" and info.value.posinf_count == 4
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.full((4,), 3.0e38).sqrt() * 1e30
    assert info.value.op == "aten.mul.Tensor"
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            r = torch.full((4,), 3.0e38).sqrt()
            r.mul_(2.0)  # written since the square root: no longer its values
            r.mul_(1e30)
    assert info.value.op == "aten.mul_.Tensor"
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.full((4,), 60000.0, dtype=torch.float16).sqrt() / 0.001  # fp16: |sqrt| <= 256
    assert info.value.op == "aten.div.Tensor" and info.value.dtype == "torch.float16"
