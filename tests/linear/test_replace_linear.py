"""replace_linear on the models people use (GPT-2's Conv1D, a Mixtral-style MoE, PEFT LoRA,
MultiheadAttention; all built from configs, random weights, offline): what it guards, what it
leaves and says so, restore_linear back to plain modules with the same Parameters, and names
that follow the model after PEFT's merge_and_unload."""

from __future__ import annotations

import copy
import logging
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

NAN = float("nan")


def gpt2(tie: bool = True):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, tie_word_embeddings=tie
    )
    return transformers.GPT2LMHeadModel(config).eval()


def mixtral():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    return transformers.MixtralForCausalLM(config).eval()


def quietly(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


IDS = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))


# -- GPT-2's Conv1D ---------------------------------------------------------------------------


def test_gpt2_every_attention_and_mlp_projection_is_guarded_and_the_logits_are_bitwise_equal():
    model = gpt2()
    with torch.no_grad():
        ref = model(IDS).logits
    params = dict(model.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left unguarded: no warning
        cg.replace_linear(model)
    convs = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    assert len(convs) == 8 and all(isinstance(model.get_submodule(n), cg.SafeConv1D) for n in convs)
    assert isinstance(model.lm_head, cg.SafeLinear)
    assert model.transformer.h[1].mlp.c_proj.guard_name == "transformer.h.1.mlp.c_proj"
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameters
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref)
    assert cg.coverage(model).left == [] and len(cg.coverage(model).guarded) == 9


@pytest.mark.parametrize("shape", [(5, 12), (3, 4, 12), (2, 3, 4, 12)])
def test_safe_conv1d_forward_is_bitwise_conv1d_and_backward_matches(shape):
    torch.manual_seed(0)
    conv = Conv1D(10, 12)
    safe = cg.SafeConv1D.from_conv1d(copy.deepcopy(conv), name="c")
    x = torch.randn(*shape, requires_grad=True)
    xs = x.detach().clone().requires_grad_()
    out, got = conv(x), safe(xs)
    assert torch.equal(got, out)
    g = torch.randn_like(out)
    out.backward(g)
    got.backward(g)
    # float64 reference: the GEMMs may sum in another order than addmm's backward
    x64, w64 = x.detach().double(), conv.weight.detach().double()
    ref_w = x64.reshape(-1, 12).T @ g.double().reshape(-1, 10)
    torch.testing.assert_close(safe.weight.grad.double(), ref_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs.grad, x.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(safe.bias.grad, conv.bias.grad, rtol=1e-6, atol=1e-6)
    del w64


def test_safe_conv1d_refuses_a_nan_input_naming_its_layer():
    safe = cg.SafeConv1D(6, 4, name="attn.c_attn")
    x = torch.randn(2, 4)
    x[1, 2] = NAN
    with pytest.raises(cg.NonFiniteInputError) as info:
        safe(x)
    assert info.value.layer == "attn.c_attn" and info.value.nan_count == 1
    with pytest.raises(cg.ShapeMismatchError):
        safe(torch.randn(2, 5))


def test_safe_conv1d_is_still_a_conv1d_with_its_own_repr_and_state_dict():
    conv = Conv1D(6, 4)
    safe = cg.SafeConv1D.from_conv1d(conv, mode="async")
    assert isinstance(safe, Conv1D) and isinstance(safe, cg.SafeConv1D)
    assert repr(safe) == "SafeConv1D(nf=6, nx=4, mode='async')"
    assert safe.state_dict().keys() == conv.state_dict().keys()
    assert safe.weight is conv.weight and safe.bias is conv.bias
    made = cg.SafeConv1D(6, 4)
    assert type(made) is type(safe) and made.weight.shape == (4, 6) and made.mode is None


def test_conv1d_false_leaves_them_and_coverage_says_so():
    model = gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # left on purpose: no warning
        cg.replace_linear(model, conv1d=False)
    assert type(model.transformer.h[0].attn.c_attn) is Conv1D and isinstance(model.lm_head, cg.SafeLinear)
    left = cg.coverage(model, conv1d=False).left
    assert len(left) == 8 and all(kind == "Conv1D" and "conv1d=False" in why for _, kind, why in left)


def test_which_selects_conv1d_by_name():
    model = gpt2()
    quietly(cg.replace_linear, model, ["transformer.h.0.attn.c_attn"])
    assert isinstance(model.transformer.h[0].attn.c_attn, cg.SafeConv1D)
    assert type(model.transformer.h[0].attn.c_proj) is Conv1D
    with pytest.raises(
        ValueError, match=r"not nn\.Linear modules of this model \(nor transformers Conv1D\): \['nope'\]"
    ):
        cg.replace_linear(model, ["nope"])


def test_a_conv1d_given_alone_is_returned_guarded():
    conv = Conv1D(3, 2)
    safe = cg.replace_linear(conv)
    assert isinstance(safe, cg.SafeConv1D) and safe.guard_name == "Conv1D" and safe.weight is conv.weight


# -- what is left, and the summary -------------------------------------------------------------


def test_mixtral_router_and_experts_are_guarded(caplog):
    """The router's own F.linear is guarded too (models/routers.py, issue 47): nothing is left."""
    model = mixtral()
    with caplog.at_level(logging.INFO, logger="cublas_guard_ext"):
        cg.replace_linear(model)
    assert "cublas_guard_ext: 7 layers guarded, 0 left unguarded" in caplog.text
    summary = cg.coverage(model)
    assert sorted(summary.guarded) == sorted(
        [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"]
        + ["lm_head", "model.layers.0.mlp.experts", "model.layers.0.mlp.gate"]
    )
    assert summary.left == []
    with torch.no_grad():
        model(IDS)  # still runs


def test_mixtral_router_named_alone_is_left_with_the_reason():
    model = mixtral()
    with pytest.warns(UserWarning, match="left 1 matmul-bearing modules unguarded") as caught:
        cg.replace_linear(model, which=["model.layers.0.mlp.experts", "lm_head"])
    text = str(caught[0].message)
    assert "model.layers.0.mlp.gate (MixtralTopKRouter): a 2-D weight (weight [4, 16])" in text


def test_multihead_attention_packed_projection_and_its_linear_subclass_are_reported():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
    with pytest.warns(UserWarning, match="left 2 matmul-bearing modules unguarded") as caught:
        cg.replace_linear(layer)
    text = str(caught[0].message)
    assert "self_attn (MultiheadAttention): MultiheadAttention multiplies its packed in_proj_weight" in text
    assert "self_attn.out_proj (NonDynamicallyQuantizableLinear): a subclass of nn.Linear" in text
    assert isinstance(layer.linear1, cg.SafeLinear) and isinstance(layer.linear2, cg.SafeLinear)


def test_a_linear_whose_forward_a_wrapper_replaced_is_left_with_that_reason():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].forward = lambda x: x  # accelerate-style instance attribute
    with pytest.warns(UserWarning, match=r"0 \(Linear\): its forward was replaced by an instance attribute"):
        cg.replace_linear(model)
    assert type(model[0]) is nn.Linear and isinstance(model[1], cg.SafeLinear)


def test_which_first_does_not_warn_about_the_ones_not_selected():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cg.replace_linear(model, "first")
    (left,) = cg.coverage(model).left
    assert left[0] == "1" and left[2].startswith("a plain nn.Linear: not selected")


# -- resize_token_embeddings ------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_the_lm_head_after_resize_token_embeddings_is_guarded(tie):
    model = gpt2(tie=tie)
    quietly(cg.replace_linear, model, mode="sync")
    old = model.lm_head
    quietly(model.resize_token_embeddings, 80)
    head = model.get_output_embeddings()
    assert isinstance(head, cg.SafeLinear) and head.out_features == 80
    assert head.guard_name == "lm_head" and head.mode == "sync"
    assert (head is old) == tie  # untied: a new Linear, guarded as it was registered
    assert cg.coverage(model).left == []
    with torch.no_grad():
        assert model(IDS).logits.shape[-1] == 80


# -- restore_linear ---------------------------------------------------------------------------


def test_restore_linear_gives_back_plain_modules_with_the_same_parameters():
    model = gpt2()
    with torch.no_grad():
        ref = model(IDS).logits
    params = dict(model.named_parameters())
    keys = model.state_dict().keys()
    types = {n: type(m) for n, m in model.named_modules()}
    cg.replace_linear(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = cg.restore_linear(model)
    assert out is model
    assert {n: type(m) for n, m in model.named_modules()} == types
    assert type(model.lm_head) is nn.Linear and type(model.transformer.h[0].attn.c_attn) is Conv1D
    assert all(p is params[n] for n, p in model.named_parameters())
    assert model.state_dict().keys() == keys
    assert not any(hasattr(m, "guard_name") for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref)
    model.train()
    model(IDS, labels=IDS).loss.backward()
    before = params["transformer.h.0.attn.c_attn.weight"].detach().clone()
    optimizer.step()  # the optimizer built on the guarded model steps the same tensors
    assert not torch.equal(model.transformer.h[0].attn.c_attn.weight, before)


def test_restore_linear_keeps_hooks_parametrizations_and_the_encoder_fast_path():
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True), num_layers=1
    )
    fast = (encoder.layers[0].activation_relu_or_gelu, encoder.use_nested_tensor)
    calls = []
    encoder.layers[0].linear1.register_forward_hook(lambda *a: calls.append(1))
    nn.utils.parametrizations.weight_norm(encoder.layers[0].linear2)
    quietly(cg.replace_linear, encoder)
    assert encoder.layers[0].activation_relu_or_gelu == 0
    assert type(encoder.layers[0].linear2).__name__ == "ParametrizedSafeLinear"
    cg.restore_linear(encoder)
    assert (encoder.layers[0].activation_relu_or_gelu, encoder.use_nested_tensor) == fast
    assert type(encoder.layers[0].linear1) is nn.Linear
    assert type(encoder.layers[0].linear2).__name__ == "ParametrizedLinear"
    assert isinstance(encoder.layers[0].linear2, nn.Linear)
    encoder(torch.randn(2, 3, 8))
    assert calls == [1]


def test_after_restore_a_new_plain_linear_in_the_slot_stays_plain():
    model = nn.Sequential(nn.Linear(4, 4))
    cg.replace_linear(model)
    cg.restore_linear(model)
    model[0] = nn.Linear(4, 4)
    assert type(model[0]) is nn.Linear


def test_restore_linear_of_a_guarded_layer_alone_returns_its_plain_twin():
    safe = cg.SafeLinear(3, 2, name="x")
    plain = cg.restore_linear(safe)
    assert type(plain) is nn.Linear and plain.weight is safe.weight
    assert repr(plain) == "Linear(in_features=3, out_features=2, bias=True)"


def test_quantize_dynamic_after_restore_linear_quantizes_every_linear():
    torch.manual_seed(0)
    model = cg.replace_linear(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    x = torch.randn(3, 8)
    with pytest.warns(UserWarning, match="left 2 guarded layer"):  # tests/linear/test_quantization.py
        skipped = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
    assert isinstance(skipped[0], cg.SafeLinear)  # what the docs warn about: the guard's type is skipped
    quantized = torch.ao.quantization.quantize_dynamic(
        cg.restore_linear(copy.deepcopy(model)), {nn.Linear}, dtype=torch.qint8
    )
    assert all("quantized" in type(quantized[i]).__module__ for i in (0, 2))
    torch.testing.assert_close(quantized(x), model(x), rtol=0.05, atol=0.05)


# -- names after PEFT's merge_and_unload --------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def test_after_peft_merge_and_unload_an_error_names_the_layer_where_it_now_is():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    lora = peft.get_peft_model(MLP(), peft.LoraConfig(target_modules=["fc1"], r=2))
    cg.replace_linear(lora)
    assert lora.base_model.model.fc1.base_layer.guard_name == "base_model.model.fc1.base_layer"
    merged = lora.merge_and_unload()
    assert isinstance(merged.fc1, cg.SafeLinear)
    x = torch.randn(2, 8)
    x[0, 1] = NAN
    with pytest.raises(cg.NonFiniteInputError) as info:
        merged(x)
    assert info.value.layer == "fc1" and str(info.value).startswith("layer 'fc1': input has 1 NaN")
    assert merged.fc1.guard_name == "fc1" and merged.fc2.guard_name == "fc2"  # all refreshed


def test_names_seen_from_a_wrapper_or_a_holder_are_kept():
    model = cg.replace_linear(MLP())
    holder = nn.Module()
    holder.net = model  # the model is now 'net' in a bigger one; its layers keep 'fc1'
    x = torch.full((2, 8), NAN)
    with pytest.raises(cg.NonFiniteInputError) as info:
        holder.net(x)
    assert info.value.layer == "fc1" and model.fc1.guard_name == "fc1"
    outer = cg.replace_linear(nn.Sequential(MLP()))  # named '0.fc1'; its block called by itself
    with pytest.raises(cg.NonFiniteInputError) as info:
        outer[0](x)
    assert info.value.layer == "0.fc1" and outer[0].fc1.guard_name == "0.fc1"
    named_by_hand = cg.SafeLinear(8, 2, name="mine")
    holder.other = named_by_hand
    with pytest.raises(cg.NonFiniteInputError) as info:
        holder.other(x)
    assert info.value.layer == "mine"


def test_peft_lora_on_gpt2_wraps_the_guarded_conv1d_and_merges_into_it():
    peft = pytest.importorskip("peft")
    model = gpt2()
    cg.replace_linear(model)
    with torch.no_grad():
        ref = model(IDS).logits
    lora = quietly(peft.get_peft_model, model, peft.LoraConfig(target_modules=["c_attn"], r=2))
    base = lora.base_model.model.transformer.h[0].attn.c_attn.base_layer
    assert isinstance(base, cg.SafeConv1D)
    with torch.no_grad():
        assert torch.equal(lora(input_ids=IDS).logits, ref)  # LoRA B starts at zero
    merged = quietly(lora.merge_and_unload)
    assert merged.transformer.h[0].attn.c_attn is base
    merged.transformer.h[0].attn.c_attn.weight.data[0, 0] = NAN
    with pytest.raises(cg.NonFiniteInputError) as info, torch.no_grad():
        merged(IDS)
    assert info.value.layer == "transformer.h.0.attn.c_attn" and info.value.role == "weight"


def test_a_guarded_gpt2_saved_whole_loads_and_deep_copies(tmp_path):
    model = gpt2()
    cg.replace_linear(model)
    with torch.no_grad():
        ref = model(IDS).logits
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    twin = copy.deepcopy(model)
    for other in (loaded, twin):
        conv = other.transformer.h[0].attn.c_attn
        assert isinstance(conv, cg.SafeConv1D) and conv.guard_name == "transformer.h.0.attn.c_attn"
        with torch.no_grad():
            assert torch.equal(other(IDS).logits, ref)


def test_added_or_looked_up_parameters_are_not_reported_as_matmuls():
    class ViTLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
            self.pos_embed = nn.Parameter(torch.zeros(1, 5, 8))
            self.relative_position_bias_table = nn.Parameter(torch.zeros(9, 2))
            self.text_projection = nn.Parameter(torch.zeros(8, 8))  # x @ text_projection: a matmul
            self.head = nn.Linear(8, 2)

    model = ViTLike()
    with pytest.warns(UserWarning, match="left 1 matmul-bearing modules unguarded"):
        cg.replace_linear(model)
    ((name, kind, why),) = cg.coverage(model).left
    assert (name, kind) == ("", "ViTLike") and "text_projection [8, 8]" in why and "pos_embed" not in why
