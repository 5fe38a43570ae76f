"""transformers' mixtures of experts through the guard: the ``cublas_guard`` experts implementation
in tiny Mixtral, Qwen3-MoE, gpt-oss and Ergo models (every experts layout: gate or not, bias,
transposed, concatenated or interleaved), equal to the model's own implementations forward and
backward, selected by replace_linear and given back by restore_linear."""

from __future__ import annotations

import pytest
import torch

import cublas_guard_ext as cg
from cublas_guard_ext.models import experts as cg_experts

from helpers import moe_models as mm

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
IDS = torch.tensor([[3, 17, 42, 8, 8, 60, 1], [5, 9, 33, 2, 47, 11, 0]])
# transformers' grouped_mm runs the same GEMM and the same sums: bit for bit.
BITWISE_GROUPED_MM = ("mixtral", "qwen3_moe", "gpt_oss", "ergo")


def loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(IDS).logits
    logits.square().mean().backward()
    return logits.detach(), {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.fixture(params=sorted(mm.MODELS))
def model_name(request: pytest.FixtureRequest) -> str:
    return request.param


def test_the_guarded_model_equals_every_implementation_forward_and_backward(model_name) -> None:
    model = mm.MODELS[model_name]()
    references = {}
    for implementation in IMPLEMENTATIONS:
        model.set_experts_implementation(implementation)
        references[implementation] = loss_and_grads(model)
    model.set_experts_implementation("grouped_mm")
    cg.replace_linear(model)  # routers guarded too: no warning
    assert model.get_experts_implementation()[""] == "cublas_guard"
    names = [n for n, _ in mm.experts_of(model)]
    assert names and all(n in cg.coverage(model).guarded for n in names)
    logits, grads = loss_and_grads(model)
    for implementation, (ref_logits, ref_grads) in references.items():
        assert grads.keys() == ref_grads.keys()
        if implementation == "grouped_mm" and model_name in BITWISE_GROUPED_MM:
            assert torch.equal(logits, ref_logits)
            assert all(torch.equal(grads[n], ref_grads[n]) for n in grads), implementation
        else:
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
            for n in grads:
                torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)
    cg.restore_linear(model)
    assert model.get_experts_implementation()[""] == "grouped_mm"
    assert not any(cg_experts.PREVIOUS_ATTR in m.__dict__ for _, m in mm.experts_of(model))
    torch.testing.assert_close(model(IDS).logits, references["grouped_mm"][0], rtol=0, atol=0)


def test_restore_gives_back_the_implementation_the_model_had() -> None:
    model = mm.mixtral(layers=1)
    model.set_experts_implementation("eager")
    cg.replace_linear(model)  # routers guarded too: no warning
    assert model.get_experts_implementation()[""] == "cublas_guard"
    cg.replace_linear(model)  # again: what it had is still eager
    cg.restore_linear(model)
    assert model.get_experts_implementation()[""] == "eager"


def test_set_experts_implementation_selects_it_and_names_come_from_the_model() -> None:
    model = mm.qwen3_moe()
    reference = loss_and_grads(model)
    model.set_experts_implementation("cublas_guard")
    logits, _ = loss_and_grads(model)
    assert torch.equal(logits, reference[0])
    assert model.model.layers[1].mlp.experts.__dict__[cg_experts.NAME_ATTR] == "model.layers.1.mlp.experts"


# -- routing: uneven, experts with no tokens, expert-parallel sentinels ------------------------------------
def experts_call(module, implementation, hidden, index, weights):
    module.config._experts_implementation_internal = implementation
    hidden = hidden.detach().clone().requires_grad_()
    weights = weights.detach().clone().requires_grad_()
    for p in module.parameters():
        p.grad = None
    out = module(hidden, index, weights)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), hidden.grad, weights.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize(
    "flags",
    [
        dict(has_gate=True, has_bias=False, is_transposed=False),
        dict(has_gate=True, has_bias=True, is_transposed=True),
        dict(has_gate=False, has_bias=True, is_transposed=False),
        dict(has_gate=False, has_bias=False, is_transposed=True, post_norm=True),
    ],
    ids=["gate", "gate_bias_transposed", "no_gate_bias", "no_gate_transposed_post_norm"],
)
def test_uneven_routing_and_empty_experts_equal_the_built_ins(flags) -> None:
    module = mm.decorated_experts(**flags)(mm.experts_config())
    tokens = 9
    hidden = torch.randn(tokens, mm.HIDDEN)
    index = torch.tensor([[0, 2]] * 6 + [[2, 0]] * 2 + [[0, 0]])  # experts 1 and 3 get nothing
    weights = torch.rand(tokens, 2)
    guarded = experts_call(module, "cublas_guard", hidden, index, weights)
    assert torch.equal(guarded[3]["down_proj"][1], torch.zeros_like(guarded[3]["down_proj"][1]))
    for implementation in IMPLEMENTATIONS:
        reference = experts_call(module, implementation, hidden, index, weights)
        for got, want in zip(guarded[:3], reference[:3]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for name in guarded[3]:
            torch.testing.assert_close(guarded[3][name], reference[3][name], rtol=1e-5, atol=1e-6)


def test_expert_parallel_sentinels_are_masked_as_the_built_ins_mask_them() -> None:
    """Tokens another rank owns arrive with ids >= num_experts and zero weights: no output, no
    gradient, finite everywhere (grouped_mm's uninitialized tail rows never reach the sum)."""
    module = mm.decorated_experts(has_gate=True, has_bias=True, is_transposed=True)(mm.experts_config())
    module._is_expert_parallel = True
    hidden = torch.randn(6, mm.HIDDEN)
    index = torch.tensor([[0, 4], [5, 1], [2, 3], [4, 4], [1, 5], [3, 0]])  # 4 and 5: sentinels
    weights = torch.rand(6, 2).masked_fill(index >= mm.EXPERTS, 0.0)
    guarded = experts_call(module, "cublas_guard", hidden, index, weights)
    assert all(torch.isfinite(t).all() for t in guarded[:3])
    for implementation in ("batched_mm", "grouped_mm"):
        reference = experts_call(module, implementation, hidden, index, weights)
        for got, want in zip(guarded[:3], reference[:3]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for name in guarded[3]:
            torch.testing.assert_close(guarded[3][name], reference[3][name], rtol=1e-5, atol=1e-6)


# -- generation ------------------------------------------------------------------------------------------
def test_generation_keeps_the_guarded_implementation_through_the_decode_switch(monkeypatch) -> None:
    """On a GPU, generate() switches grouped_mm to batched_mm for decoding: the guarded
    implementation is not switched (checked by making the model look like it is on CUDA)."""
    model = mm.mixtral()
    expected = model.generate(IDS, max_new_tokens=4, do_sample=False)
    cg.replace_linear(model)  # routers guarded too: no warning
    assert torch.equal(model.generate(IDS, max_new_tokens=4, do_sample=False), expected)
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    with model._optimize_model_for_decode():
        assert model.get_experts_implementation()[""] == "cublas_guard"
    cg.restore_linear(model)
    with model._optimize_model_for_decode():  # the test's premise: grouped_mm is switched
        assert model.get_experts_implementation()[""] == "batched_mm"


# -- training -----------------------------------------------------------------------------------------------
def test_a_few_adamw_steps_equal_the_unguarded_model(model_name) -> None:
    guarded, plain = mm.MODELS[model_name](), mm.MODELS[model_name]()
    plain.load_state_dict(guarded.state_dict())
    cg.replace_linear(guarded)  # routers guarded too: no warning
    runs = []
    for model in (guarded, plain):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            optimizer.zero_grad()
            loss = model(IDS, labels=IDS.roll(step + 1, 1)).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        runs.append((losses, {n: p.detach() for n, p in model.named_parameters()}))
    (losses, params), (ref_losses, ref_params) = runs
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for name in params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=1e-5, atol=1e-6, msg=name)


# -- coverage ------------------------------------------------------------------------------------------------
def test_coverage_names_other_3d_expert_modules_as_left() -> None:
    model = torch.nn.ModuleDict({"moe": mm.mixtral(layers=1), "own": mm.OwnExperts()})
    with pytest.warns(UserWarning, match=r"own \(OwnExperts\): fused 3-D weights \(w \[4, 16, 16\]"):
        cg.replace_linear(model)
    summary = cg.coverage(model)
    assert "moe.model.layers.0.mlp.experts" in summary.guarded
    left = {name: reason for name, _, reason in summary.left}
    assert "bmm, einsum, grouped_mm" in left["own"] and "not guarded" in left["own"]


def test_coverage_says_which_implementation_an_unguarded_experts_module_runs() -> None:
    model = mm.gpt_oss(layers=1)
    model.set_experts_implementation("batched_mm")
    left = {name: reason for name, _, reason in cg.coverage(model).left}
    reason = left["model.layers.0.mlp.experts"]
    assert "'batched_mm' implementation" in reason and "replace_linear(model)" in reason


def test_replace_linear_which_names_an_experts_module() -> None:
    model = mm.mixtral()
    with pytest.warns(UserWarning):  # which= names the experts alone: the routers stay unguarded
        cg.replace_linear(model, which=["model.layers.0.mlp.experts"])
    # one config for both layers: transformers chooses per config, so both are guarded
    assert model.get_experts_implementation()[""] == "cublas_guard"
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, cg.SafeLinear)


@pytest.mark.slow
def test_torch_compile_of_a_guarded_model_is_bitwise_and_still_refuses() -> None:
    model = mm.mixtral()
    reference = model(IDS).logits
    cg.replace_linear(model)  # names the experts (a compiled first call cannot walk the stack)
    compiled = torch.compile(model, backend="aot_eager")
    logits = compiled(IDS).logits
    assert torch.equal(logits, reference)
    logits.square().mean().backward()
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad.abs().sum() > 0
    with torch.no_grad():
        model.model.layers[1].mlp.experts.gate_up_proj[1, 0, 0] = float("nan")
    with pytest.raises(cg.NonFiniteInputError) as info:
        compiled(IDS)
    assert info.value.layer == "model.layers.1.mlp.experts.gate_up_proj[1]" and info.value.expert == 1


def test_an_experts_module_without_stacked_weights_is_refused_by_name() -> None:
    module = mm.decorated_experts(has_gate=True, has_bias=False, is_transposed=False)(
        mm.experts_config("cublas_guard")
    )
    module.gate_up_proj = torch.nn.Parameter(torch.randn(24, mm.HIDDEN))  # not [experts, ., .]
    with pytest.raises(cg.errors.ExpertsImplementationError) as info:
        module(torch.randn(3, mm.HIDDEN), torch.tensor([[0, 1]] * 3), torch.rand(3, 2))
    assert isinstance(info.value, TypeError) and info.value.module_type == "Experts"
    assert "its gate_up_proj is not a 3-D tensor of stacked experts (Parameter)" in str(info.value)
