"""MoE routers guarded like the experts (issue 47, point 6): transformers' routers multiply their
2-D weight with F.linear in their own forward; replace_linear now sends that product through the
guard (models/routers.py): bitwise equal when clean, a non-finite router weight or input refused
naming the router, restore_linear undoes it."""

from __future__ import annotations

import copy

import pytest
import torch

import cublas_guard_ext as cg

from helpers.moe_models import deepseek_v3, gpt_oss, mixtral, qwen3_moe

MODELS = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "gpt_oss": gpt_oss, "deepseek_v3": deepseek_v3}


@pytest.mark.parametrize("build", MODELS.values(), ids=list(MODELS))
def test_guarded_routers_are_bitwise_equal_when_clean(build):
    torch.manual_seed(0)
    plain = build()
    guarded = cg.replace_linear(copy.deepcopy(plain))
    routers = [n for n, m in guarded.named_modules() if cg.models.routers.is_guarded_router(m)]
    assert routers and all(n.endswith(".mlp.router") or n.endswith(".mlp.gate") for n in routers)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, guarded(ids).logits)
    summary = cg.coverage(guarded)
    assert set(routers) <= set(summary.guarded)
    assert not any(name in routers for name, _, _ in summary.left)


def test_a_nan_in_the_router_weight_is_refused_naming_the_router():
    torch.manual_seed(0)
    model = cg.replace_linear(mixtral())
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight[1, 3] = float("nan")
    with pytest.raises(cg.NonFiniteInputError) as info:
        with torch.no_grad():
            model(torch.randint(0, 64, (1, 5)))
    err = info.value
    assert err.layer == "model.layers.0.mlp.gate" and err.role == "weight"
    assert "layer 'model.layers.0.mlp.gate'" in str(err)


def test_a_router_that_converts_its_weight_first_is_guarded_too():
    # DeepSeek-V3: F.linear(x.type(torch.float32), self.weight.type(torch.float32)); with a bf16
    # weight the product's weight is a new float32 tensor, not the parameter.
    torch.manual_seed(0)
    model = cg.replace_linear(deepseek_v3().to(torch.bfloat16))
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.bfloat16
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight[2, 5] = float("inf")
    with pytest.raises(cg.NonFiniteInputError) as info:
        with torch.no_grad():
            model(torch.randint(0, 64, (1, 5)))
    err = info.value
    assert err.layer == "model.layers.1.mlp.gate" and err.role == "weight"
    assert (err.posinf_count, err.first_bad_index) == (1, 2 * 16 + 5)


def test_a_converting_router_guarded_is_bitwise_equal_when_clean():
    torch.manual_seed(0)
    plain = deepseek_v3().to(torch.bfloat16)
    plain.set_experts_implementation("eager")  # torch's CPU grouped GEMM refuses these bf16 strides
    guarded = copy.deepcopy(plain)
    assert cg.models.routers.guard_routers(guarded) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, guarded(ids).logits)


def test_restore_linear_unguards_the_routers():
    model = cg.restore_linear(cg.replace_linear(mixtral()))
    assert not any(cg.models.routers.is_guarded_router(m) for m in model.modules())
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight[1, 3] = float("nan")
        model(torch.randint(0, 64, (1, 5)))  # unguarded again: no refusal at the router


@pytest.mark.parametrize("build", MODELS.values(), ids=list(MODELS))
def test_under_cpu_bf16_autocast_the_guarded_model_matches_bitwise(build):
    """transformers' _grouped_mm runs the experts in the weights' dtype (torch's grouped GEMM is
    not autocast-aware); the guarded grouped op follows that policy, so the logits match bit for
    bit (before, the guarded op ran in bf16: 2e-2 apart)."""
    torch.manual_seed(0)
    plain = build()
    plain.set_experts_implementation("grouped_mm")
    guarded = cg.replace_linear(copy.deepcopy(plain))
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = plain(ids).logits, guarded(ids).logits
    assert got.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(got, expected)


@pytest.mark.locked  # watch places it: it needs the version-locked library
def test_router_logits_past_the_range_are_explained_as_router_instability():
    class Moe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(64, 4, bias=False).half()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gate(x).float().softmax(-1)

    model = Moe()
    with torch.no_grad():
        model.gate.weight.fill_(40.0)  # 64 x 40 x 40 = 102400 > 65504
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            model(torch.full((2, 64), 40.0, dtype=torch.float16))
    err = info.value
    assert err.overflow and err.module == "gate"
    assert "router logits past the range are router instability" in str(err)
    assert "router z-loss" in str(err)
