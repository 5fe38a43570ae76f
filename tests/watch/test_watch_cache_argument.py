"""NaN only at masked-out positions of a KV cache read by SDPA (issue 47, point 3): named at the
attention op and module, with the positions, the mask that excluded them, why they still reach
the output (0 x NaN) and the fix (zeros); never the learning rate. An entry finding for a cache
argument gives the same fix first."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers.watch_models import nothing_left

DOC = Path(__file__).resolve().parents[2] / "docs" / "nan-stories.md"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(
        self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int
    ) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        n = x.shape[1]
        k_cache[:, :, pos : pos + n] = k
        v_cache[:, :, pos : pos + n] = v
        mask = torch.zeros(1, 1, n, 16, dtype=torch.bool)
        mask[..., : pos + n] = True
        return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)


class CacheArgAttn(nn.Module):
    """The cache is the caller's (a preallocated past key/value), written at ``pos``."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Block()
        self.out = nn.Linear(16, 16)

    def forward(
        self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int
    ) -> torch.Tensor:
        y = self.attn(x, k_cache, v_cache, pos)
        return self.out(y.transpose(1, 2).reshape(1, x.shape[1], 16))


def _caches(fill: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor]:
    # torch.empty's recycled memory, made visible
    return torch.full((1, 2, 16, 8), fill), torch.full((1, 2, 16, 8), fill)


def _decode(model: nn.Module, k: torch.Tensor, v: torch.Tensor, **watch_kwargs) -> torch.Tensor:
    with torch.no_grad():
        model(torch.randn(1, 4, 16), k, v, 0)  # the prefill, unwatched: positions 0..3
        with cg.watch(model, mode="sync", **watch_kwargs):
            return model(torch.randn(1, 1, 16), k, v, 4)


def test_nan_only_at_masked_cache_positions_is_named_at_the_attention():
    torch.manual_seed(0)
    with pytest.raises(cg.NonFiniteMaskedKeysError) as info:
        _decode(CacheArgAttn().eval(), *_caches())
    err = info.value
    assert err.op == "aten::scaled_dot_product_attention" and err.module == "module 'attn'"
    assert err.positions == list(range(5, 16)) and err.keys == 16
    assert err.operands == "key 'k_cache' and value 'v_cache'"
    assert (err.out_nan, err.out_numel) == (16, 16)
    text = str(err)
    assert text.startswith(
        "watch: aten::scaled_dot_product_attention in module 'attn' made 16 NaN of 16 output values from "
        "key 'k_cache' and value 'v_cache' whose non-finite values sit only at masked-out key positions"
    )
    assert "key positions 5..15 of 16 hold NaN/Inf (key: 176 NaN, 0 Inf; value: 176 NaN, 0 Inf)" in text
    assert (
        "the attn_mask argument (bool, False = masked, shape [1, 1, 1, 16]) excludes those positions" in text
    )
    assert "0 x NaN = NaN" in text and "torch.zeros, not torch.empty" in text
    assert "learning rate" not in text and "under watch" not in text
    section = DOC.read_text().split("## NaN in a cache's unused positions\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```\n(.*?)\n```", section, re.S)
    assert f"{type(err).__name__}: {text}" in blocks  # the doc shows it word for word
    nothing_left()


def test_a_float_mask_and_a_causal_mask_are_named_too():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 8)
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    k[:, :, 4:] = float("nan")
    bias = torch.zeros(4, 6)
    bias[:, 4:] = float("-inf")
    with pytest.raises(cg.NonFiniteMaskedKeysError) as info, cg.watch(mode="sync"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert info.value.positions == [4, 5]
    assert info.value.mask == "the attn_mask argument (torch.float32, -inf = masked, shape [4, 6])"
    assert info.value.module == "no watched module (outside the model, or watch without one)"
    # torch's is_causal is top-left aligned: with 4 queries and 6 keys, keys 4 and 5 are masked for
    # all; a NaN key alone is masked_fill'ed away there, a NaN value is not (0 x NaN)
    v[:, :, 4:] = float("nan")
    with pytest.raises(cg.NonFiniteMaskedKeysError) as info, cg.watch(mode="sync"):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert info.value.positions == [4, 5] and info.value.mask == "is_causal=True"


def test_nan_the_mask_lets_in_is_not_called_masked():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    k[:, :, 1] = float("nan")
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:, 4:] = False  # key 1 is attended
    with cg.watch(mode="sync"):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # no masked-keys finding
    assert torch.isnan(out).all()


def test_a_zero_filled_cache_runs_clean_and_bitwise_equal():
    torch.manual_seed(0)
    model = CacheArgAttn().eval()
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        plain = model(x, *_caches(0.0), 0)
        with cg.watch(model, mode="sync"):
            watched = model(x, *_caches(0.0), 0)
    assert torch.equal(plain, watched)
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # patch removed
    nothing_left()


def test_a_cache_argument_found_on_entry_is_told_to_fill_with_zeros_first():
    # report="birth" judges arguments on entry: the cache's fix first, never "the batch"
    torch.manual_seed(0)
    with pytest.raises(cg.NonFiniteEntryError) as info:
        _decode(CacheArgAttn().eval(), *_caches(), report="birth")
    err = info.value
    assert err.role == "argument" and err.name == "k_cache"
    next_lines = str(err).split("\nNext: ", 1)[1].splitlines()
    assert next_lines[0].startswith(
        "a cache passed in (past key/values) with non-finite unused positions: fill it with zeros where "
        "it is allocated (torch.zeros, not torch.empty): masked-out positions still enter attention's "
        "products (weight 0 x NaN = NaN in every output)"
    )
    assert next_lines[1].strip() == "if it is data, not a cache: check the data pipeline"
    assert "the batch was already non-finite" not in str(err) and "learning rate" not in str(err)
    nothing_left()


def test_a_non_finite_batch_still_points_at_the_data_pipeline():
    model = nn.Linear(4, 4)
    with pytest.raises(cg.NonFiniteEntryError) as info:
        with cg.watch(model, mode="sync"):
            model(torch.tensor([[1.0, float("nan"), 0.0, 2.0]]))
    assert (
        str(info.value)
        .split("\nNext: ", 1)[1]
        .startswith("check the data pipeline: the batch was already non-finite")
    )
    nothing_left()


def test_async_mode_on_the_cpu_names_it_at_the_attention_too():
    torch.manual_seed(0)
    with pytest.raises(cg.NonFiniteMaskedKeysError) as info:
        with torch.no_grad(), cg.watch(mode="async"):
            k, v = _caches()
            k[:, :, :4], v[:, :, :4] = 0.0, 0.0
            F.scaled_dot_product_attention(
                torch.randn(1, 2, 1, 8), k, v, attn_mask=(torch.arange(16) < 4)[None]
            )
    assert info.value.positions == list(range(4, 16))
    nothing_left()
