"""watch's entry finding for a KV cache passed in as an argument (issue 47, point 3): its fix
(zeros, not torch.empty) comes first, and it is never told that "the batch" was non-finite."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers.watch_models import nothing_left


class CacheArgAttn(nn.Module):
    """The cache is the caller's (a preallocated past key/value), written at ``pos`` and read
    through SDPA with a mask that excludes the unused positions."""

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


def test_a_cache_argument_is_told_to_fill_with_zeros_first_not_to_check_the_batch():
    torch.manual_seed(0)
    model = CacheArgAttn().eval()
    k_cache = torch.full((1, 2, 16, 8), float("nan"))  # torch.empty's recycled memory, made visible
    v_cache = torch.full((1, 2, 16, 8), float("nan"))
    with torch.no_grad():
        model(torch.randn(1, 4, 16), k_cache, v_cache, 0)  # the prefill, unwatched: positions 0..3
        with pytest.raises(cg.NonFiniteEntryError) as info:
            with cg.watch(model, mode="sync"):
                model(torch.randn(1, 1, 16), k_cache, v_cache, 4)
    err = info.value
    assert err.role == "argument" and err.name == "k_cache"
    text = str(err)
    next_lines = text.split("\nNext: ", 1)[1].splitlines()
    assert next_lines[0].startswith(
        "a cache passed in (past key/values) with non-finite unused positions: fill it with zeros where "
        "it is allocated (torch.zeros, not torch.empty): masked-out positions still enter attention's "
        "products (weight 0 x NaN = NaN in every output)"
    )
    assert next_lines[1].strip() == "if it is data, not a cache: check the data pipeline"
    assert "the batch was already non-finite" not in text and "learning rate" not in text
    doc = (Path(__file__).resolve().parents[2] / "docs" / "nan-stories.md").read_text()
    section = doc.split("## NaN in a cache's unused positions\n", 1)[1].split("\n## ", 1)[0]
    assert f"{type(err).__name__}: {text}" in re.findall(r"```\n(.*?)\n```", section, re.S)  # word for word
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
