"""watch: a NaN made from inputs that held Inf but no NaN is a birth (issue 47, point 2).

The rule is csrc/locked/watch/watch_device_logic.h's (``kTagInf``), shared with the CUDA kernel: a
``masked_fill(..., -inf)`` output holds -inf and no NaN; a softmax over a row whose every score is
-inf makes NaN (0/0) from it, so that softmax is where the NaN was born. Masks that leave every
query a key (causal, sliding window, padding on either side) stay silent, and SDPA, which returns
0 for a fully masked query, has nothing to report.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers.watch_models import nothing_left

B, T, D, H = 2, 6, 16, 2


class Attn(nn.Module):
    def __init__(self, sdpa: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.sdpa = sdpa

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(D // H)
            out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(B, T, D))


class Model(nn.Module):
    def __init__(self, sdpa: bool = False) -> None:
        super().__init__()
        self.attn = Attn(sdpa)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, allowed))


def _mask(padding: str, window: int | None = None) -> torch.Tensor:
    """(B, 1, T, T) bool, True where a query may attend: causal, the padding of sequence 0."""
    keep = torch.ones(B, T, dtype=torch.bool)
    if padding == "left":
        keep[0, :2] = False
    elif padding == "right":
        keep[0, -2:] = False
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    if window is not None:
        allowed &= torch.ones(T, T, dtype=torch.bool).triu(-window + 1)
    return allowed & keep[:, None, None, :]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_left_padding_with_a_causal_mask_names_the_softmax_and_the_masked_rows(mode):
    torch.manual_seed(0)
    model = Model()
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode=mode):
            model(torch.randn(B, T, D), _mask("left"))
    err = info.value
    assert err.op == "aten._softmax.default" and err.module == "attn" and err.phase == "forward"
    # sequence 0's first two queries see only its two padding keys: 2 queries x 2 heads
    assert err.nan_count == 4 * T and err.first_bad_coords == [0, 0, 0, 0]
    text = str(err)
    assert "produced 24 NaN, 0 +Inf, 0 -Inf from inputs that held Inf but no NaN" in text
    assert (
        "4 of 24 (batch, head, query) rows had every key masked; the first at (batch, head, query) (0, 0, 0)"
        in text
    )
    assert "pytorch#41508" in text and "torch.finfo(scores.dtype).min" in text
    assert "allow=" not in text
    assert err.reached == "the model's output"
    nothing_left()


def test_report_birth_names_the_softmax_without_a_model():
    torch.manual_seed(0)
    attn = Attn()
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(mode="sync"):
            attn(torch.randn(B, T, D), _mask("left"))
    assert info.value.op == "aten._softmax.default" and info.value.nan_count == 4 * T


@pytest.mark.parametrize(
    "padding, window, sdpa",
    [
        ("right", None, False),
        ("none", None, False),
        ("none", 3, False),  # sliding window
        ("none", 1, False),  # each query sees only itself
        ("left", None, True),  # SDPA returns 0 for the fully masked queries
        ("right", None, True),
    ],
)
def test_masks_that_leave_every_query_a_key_are_silent(padding, window, sdpa):
    torch.manual_seed(0)
    model = Model(sdpa=sdpa)
    with cg.watch(model, mode="sync"):
        out = model(torch.randn(B, T, D), _mask(padding, window))
        out.square().mean().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_an_additive_mask_made_before_the_block_is_intended_too():
    """A -inf mask made before the block (first seen inside it) holds no NaN: the softmax over a
    fully masked row is where the NaN is born, also in report='birth'."""
    scores = torch.randn(1, 1, 3, 3)
    mask = torch.full((3, 3), float("-inf")).triu(1)  # causal
    mask[0, 0] = float("-inf")  # query 0 sees nothing
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(mode="sync"):
            (scores + mask).softmax(-1)
    assert info.value.op == "aten._softmax.default" and info.value.nan_count == 3


def test_a_difference_of_infinities_is_a_birth():
    inf = torch.zeros(4).masked_fill(torch.tensor([True, False, True, False]), float("inf"))
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(mode="sync"):
            x = torch.zeros(4).masked_fill(torch.tensor([True, False, True, False]), float("inf"))
            x - inf.clone()
    err = info.value
    assert err.op == "aten.sub.Tensor" and err.nan_count == 2
    assert "a difference of two infinities of the same sign" in str(err)


def test_zero_times_infinity_is_a_birth():
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(mode="sync"):
            neg = torch.zeros(4).masked_fill(torch.tensor([True, True, False, False]), float("-inf"))
            torch.tensor([0.0, 1.0, 1.0, 0.0]) * neg
    err = info.value
    assert err.op == "aten.mul.Tensor" and err.nan_count == 1 and err.neginf_count == 1
    assert "0 * Inf" in str(err)


def test_a_nan_from_a_nan_carrying_input_is_still_not_a_birth():
    """Inf and NaN made before the block: the NaN after it is theirs, not a new one."""
    before = torch.tensor([float("nan"), float("-inf"), 1.0])
    with cg.watch(mode="sync"):
        before.softmax(-1)  # NaN everywhere, inherited from the NaN it read


def test_an_fp16_score_overflow_in_attention_adds_the_attention_fixes():
    class Scores(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return (q @ k.transpose(-1, -2)) / 8.0

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Scores()

        def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return self.attn(q, k)

    q = torch.full((1, 4, 64), 40.0, dtype=torch.float16)  # 64 x 40 x 40 = 102400 > 65504
    model = Net()
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            model(q, q)
    err = info.value
    assert err.overflow and err.module == "attn"
    assert "scale q by 1/sqrt(head_dim) before the product" in str(err)
