"""watch's findings for a cache or buffer (issue 47, point 3): a cache buffer's masked-out NaN
named at the attention with the mask; otherwise where the non-finite values sit (a KV cache's
unused positions), why a mask does not keep them out, the fix (zeros), and never the learning
rate for a buffer."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers.watch_models import nothing_left


class CachedAttn(nn.Module):
    """A preallocated KV cache (uninitialized memory stands in as NaN), written position by
    position, read through SDPA with a mask that excludes the unused positions."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.register_buffer("k_cache", torch.full((1, 2, 16, 8), float("nan")))
        self.register_buffer("v_cache", torch.full((1, 2, 16, 8), float("nan")))

    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        n = x.shape[1]
        self.k_cache[:, :, pos : pos + n] = k
        self.v_cache[:, :, pos : pos + n] = v
        mask = torch.zeros(1, 1, n, 16, dtype=torch.bool)
        mask[..., : pos + n] = True
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)


def _decoding_finding(model: nn.Module, error: type[Exception], **watch_kwargs) -> Exception:
    """The prefill (positions 0..3) unwatched, then one decoding step (position 4) inside
    ``cg.watch(model, **watch_kwargs)``: the finding it raises."""
    with torch.no_grad():
        model(torch.randn(1, 4, 16), 0)
        with pytest.raises(error) as info, cg.watch(model, **watch_kwargs):
            model(torch.randn(1, 1, 16), 4)
    return info.value


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_cache_buffer_with_nan_in_its_unused_positions_is_named_at_the_attention(mode):
    torch.manual_seed(0)
    model = CachedAttn().eval()
    with torch.no_grad():
        out = model(torch.randn(1, 4, 16), 0)  # the prefill, unwatched: NaN everywhere
        assert out.isnan().all()  # 0 x NaN: the mask does not keep the unused positions out
        with pytest.raises(cg.NonFiniteMaskedKeysError) as info:
            with cg.watch(model, mode=mode):
                model(torch.randn(1, 1, 16), 4)
    err = info.value
    assert err.operands == "key buffer 'k_cache' and value buffer 'v_cache'"
    assert err.positions == list(range(5, 16)) and err.keys == 16
    text = str(err)
    assert (
        "the attn_mask argument (bool, False = masked, shape [1, 1, 1, 16]) excludes those positions" in text
    )
    assert "fill the cache with zeros" in text and "0 x NaN = NaN" in text
    assert "learning rate" not in text
    nothing_left()


def test_a_wholly_nan_cache_buffer_is_named_at_the_prefills_attention():
    # torch.empty memory before the first write: the prefill writes positions 0..3, the mask
    # excludes 4..15, and SDPA is where they turn the output NaN
    torch.manual_seed(0)
    model = CachedAttn().eval()
    with pytest.raises(cg.NonFiniteMaskedKeysError) as info, torch.no_grad():
        with cg.watch(model, mode="sync"):
            model(torch.randn(1, 4, 16), 0)
    assert info.value.operands == "key buffer 'k_cache' and value buffer 'v_cache'"
    assert info.value.positions == list(range(4, 16))
    nothing_left()


def test_a_cache_buffer_is_judged_on_entry_under_report_birth():
    torch.manual_seed(0)
    model = CachedAttn().eval()
    err = _decoding_finding(model, cg.NonFiniteEntryError, mode="sync", report="birth")
    assert err.role == "buffer" and err.name == "k_cache"
    assert err.bad_slices == [(2, 4, 15, 16)]  # positions 4..15 of 16 never written
    text = str(err)
    assert (
        "the non-finite values sit only at these positions (the rest is finite): dim 2: 4..15 of 16" in text
    )
    assert "fill it with zeros" in text and "0 x NaN = NaN" in text
    assert "learning rate" not in text
    nothing_left()


class EagerCachedAttn(CachedAttn):
    """The same cache, read by an eager attention: masked_fill(-inf), softmax, probs @ v.
    ``lets_in`` key positions past the written ones are left unmasked (a wrong mask)."""

    lets_in = 0

    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        n = x.shape[1]
        self.k_cache[:, :, pos : pos + n] = k
        self.v_cache[:, :, pos : pos + n] = v
        scores = (q @ self.k_cache.transpose(-2, -1)) / 8**0.5
        scores = scores.masked_fill(torch.arange(16) >= pos + n + self.lets_in, float("-inf"))
        return scores.softmax(-1) @ self.v_cache


class AdditiveMaskAttn(CachedAttn):
    """transformers' eager attention: an additive float mask (the dtype's lowest value), then
    torch.matmul(weights, value)."""

    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        n = x.shape[1]
        self.k_cache[:, :, pos : pos + n] = k
        self.v_cache[:, :, pos : pos + n] = v
        causal_mask = torch.zeros(1, 1, n, 16)
        causal_mask[..., pos + n :] = torch.finfo(torch.float32).min
        scores = torch.matmul(q, self.k_cache.nan_to_num().transpose(-2, -1)) / 8**0.5 + causal_mask
        return torch.matmul(scores.softmax(-1), self.v_cache)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_eager_attentions_masked_cache_nan_is_named_at_its_product(mode):
    torch.manual_seed(0)
    model = EagerCachedAttn().eval()
    err = _decoding_finding(model, cg.NonFiniteMaskedKeysError, mode=mode)
    # masked_fill replaced k's NaN scores; v's NaN rows reach the output through 0 x NaN
    assert err.op == "aten::matmul" and err.operands == "value buffer 'v_cache'"
    assert err.positions == list(range(5, 16)) and err.keys == 16
    text = str(err)
    assert "the watched model (EagerCachedAttn)" in text
    assert "the mask applied before the softmax (it left those weights exactly 0) excludes" in text
    assert "fill the cache with zeros" in text and "0 x NaN = NaN" in text
    assert "learning rate" not in text
    assert torch.matmul is torch._C._VariableFunctions.matmul  # the product's patch is gone
    assert "__matmul__" not in torch.Tensor.__dict__
    nothing_left()


def test_an_additive_mask_in_sight_is_named():
    torch.manual_seed(0)
    model = AdditiveMaskAttn().eval()
    err = _decoding_finding(model, cg.NonFiniteMaskedKeysError, mode="sync")
    assert err.positions == list(range(5, 16))
    assert "the mask 'causal_mask' (torch.float32, -inf = masked, shape [1, 1, 1, 16])" in str(err)
    nothing_left()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_cache_buffer_reaching_the_output_otherwise_is_named_as_a_buffer_with_its_positions(mode):
    torch.manual_seed(0)
    model = EagerCachedAttn().eval()
    model.lets_in = 1  # key position 5 is NaN and unmasked: no mask kept it out
    err = _decoding_finding(model, cg.NonFiniteEntryError, mode=mode)
    assert err.role == "buffer" and err.name == "k_cache"  # its NaN score reaches first
    assert err.bad_slices == [(2, 4, 15, 16)]  # as on entry, like the counts
    text = str(err)
    assert text.startswith("watch: the model's buffer 'k_cache' has 192 NaN, 0 +Inf, 0 -Inf on entry"), text
    assert "fill it with zeros" in text and "learning rate" not in text
    nothing_left()


def test_a_cache_buffer_read_only_where_written_is_no_finding():
    torch.manual_seed(0)
    model = CachedAttn().eval()

    def sliced(x: torch.Tensor, pos: int) -> torch.Tensor:
        q, k, v = model.qkv(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        model.k_cache[:, :, pos : pos + 1] = k
        model.v_cache[:, :, pos : pos + 1] = v
        return F.scaled_dot_product_attention(
            q, model.k_cache[:, :, : pos + 1], model.v_cache[:, :, : pos + 1]
        )

    x = torch.randn(1, 1, 16)
    with torch.no_grad():
        plain = sliced(x, 0)
        with cg.watch(model, mode="sync"):
            watched = sliced(x, 0)
    assert torch.equal(plain, watched) and torch.isfinite(watched).all()
    nothing_left()


def test_a_running_statistic_is_still_refused_on_entry():
    # batch norm writes its running stats back through arguments watch does not read: a
    # non-finite one is refused when the block starts, not left to what it reaches
    bn = nn.BatchNorm1d(4)
    with torch.no_grad():
        bn.running_mean[1] = float("nan")
    with pytest.raises(cg.NonFiniteEntryError) as info:
        with cg.watch(bn, mode="sync"):
            bn(torch.randn(8, 4))
    assert info.value.role == "buffer" and info.value.name == "running_mean"
    nothing_left()


def test_a_non_finite_parameter_on_entry_still_advises_the_learning_rate():
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight[1, 2] = float("inf")
    with pytest.raises(cg.NonFiniteEntryError) as info:
        with cg.watch(model, mode="sync"):
            model(torch.ones(1, 4))
    assert info.value.role == "parameter" and info.value.bad_slices == [(0, 1, 1, 4), (1, 2, 2, 4)]
    assert "lower the learning rate" in str(info.value)


def test_a_zero_filled_cache_runs_clean():
    model = CachedAttn().eval()
    model.k_cache.zero_()
    model.v_cache.zero_()
    with torch.no_grad(), cg.watch(model, mode="sync"):
        out = model(torch.randn(1, 4, 16), 0)
        # no buffer non-finite on entry: eager attention's products are not routed through Python
        assert torch.matmul is torch._C._VariableFunctions.matmul
    assert torch.isfinite(out).all()
