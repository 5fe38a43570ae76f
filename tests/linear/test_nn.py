"""SafeLinear as a drop-in nn.Linear, and the helpers that swap it in."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import cublas_guard_ext as cg

from helpers import assert_matches

NAN = float("nan")


def test_same_parameters_init_and_state_dict_keys() -> None:
    torch.manual_seed(3)
    ref = nn.Linear(11, 5)
    torch.manual_seed(3)
    safe = cg.SafeLinear(11, 5)
    assert torch.equal(ref.weight, safe.weight) and torch.equal(ref.bias, safe.bias)
    assert list(safe.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    assert [n for n, _ in safe.named_parameters()] == ["weight", "bias"]
    assert list(cg.SafeLinear(3, 2, bias=False).state_dict()) == ["weight"]
    assert isinstance(safe, nn.Linear)


def test_state_dicts_load_both_ways() -> None:
    ref, safe = nn.Linear(6, 3), cg.SafeLinear(6, 3)
    safe.load_state_dict(ref.state_dict())
    assert torch.equal(safe.weight, ref.weight)
    other = nn.Linear(6, 3)
    other.load_state_dict(safe.state_dict())
    assert torch.equal(other.bias, safe.bias)


def test_repr_like_nn_linear() -> None:
    assert repr(cg.SafeLinear(4, 2)) == "SafeLinear(in_features=4, out_features=2, bias=True)"
    assert repr(cg.SafeLinear(4, 2, bias=False, mode="async")) == (
        "SafeLinear(in_features=4, out_features=2, bias=False, mode='async')"
    )


def test_dtype_and_device_arguments() -> None:
    safe = cg.SafeLinear(4, 2, device="cpu", dtype=torch.float32)
    assert safe.weight.dtype == torch.float32 and safe.weight.device.type == "cpu"
    meta = cg.SafeLinear(4, 2, device="meta")
    assert meta.weight.is_meta


def test_trains_like_nn_linear(device: str) -> None:
    """Same data, same init, same optimizer: the same parameters after training."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)
    safe = cg.replace_linear(copy.deepcopy(ref))
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt_safe = torch.optim.Adam(safe.parameters(), lr=1e-2)
    data = torch.randn(20, 32, 10, device=device)
    target = torch.randn(20, 32, 3, device=device)
    for x, t in zip(data, target):
        for model, opt in ((ref, opt_ref), (safe, opt_safe)):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), t).backward()
            opt.step()
    for p_ref, p_safe in zip(ref.parameters(), safe.parameters()):
        assert_matches(p_safe, p_ref, rel=1e-4)


def test_save_and_load_whole_model(tmp_path) -> None:
    model = cg.replace_linear(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert isinstance(loaded[0], cg.SafeLinear) and loaded[0].guard_name == "0"
    x = torch.randn(3, 4)
    assert torch.equal(loaded(x), model(x))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    plain.load_state_dict(torch.load(buffer))
    assert torch.equal(plain(x), model(x))


def test_train_eval_and_to() -> None:
    safe = cg.SafeLinear(4, 2)
    assert safe.eval().training is False and safe.train().training is True
    assert safe.to(torch.float32) is safe
    moved = safe.to("meta")
    assert moved.weight.is_meta


def test_from_linear_shares_parameters() -> None:
    linear = nn.Linear(5, 3)
    opt = torch.optim.SGD(linear.parameters(), lr=0.1)
    safe = cg.SafeLinear.from_linear(linear, name="head")
    assert safe.weight is linear.weight and safe.bias is linear.bias
    before = linear.weight.detach().clone()
    safe(torch.randn(2, 5)).sum().backward()
    opt.step()  # the optimizer built before the swap updates the shared tensors
    assert not torch.equal(safe.weight, before)
    assert cg.SafeLinear.from_linear(nn.Linear(5, 3, bias=False)).bias is None
    with pytest.raises(TypeError, match="expects an nn.Linear"):
        cg.SafeLinear.from_linear(nn.Conv1d(1, 1, 1))  # type: ignore[arg-type]


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 8)  # registered first, called second
        self.embed = nn.Linear(4, 6)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(torch.relu(self.embed(x)))
        return self.attn(h, h, h, need_weights=False)[0]


def test_replace_all_names_layers_and_keeps_outputs() -> None:
    model = nn.Sequential(Encoder(), nn.Linear(8, 2))
    x = torch.randn(2, 5, 4)
    expected = model(x)
    out = cg.replace_linear(model, mode="sync")
    assert out is model
    assert isinstance(model[0].embed, cg.SafeLinear) and model[0].embed.guard_name == "0.embed"
    assert model[1].guard_name == "1" and model[1].mode == "sync"
    # nn.MultiheadAttention's out_proj is a Linear subclass used without forward: kept
    assert type(model[0].attn.out_proj) is not cg.SafeLinear
    assert_matches(model(x), expected)


def test_replace_first_by_registration_or_by_call_order() -> None:
    by_registration = cg.replace_linear(Encoder(), which="first")
    assert isinstance(by_registration.proj, cg.SafeLinear)
    assert not isinstance(by_registration.embed, cg.SafeLinear)
    by_call = cg.replace_linear(Encoder(), which="first", example_inputs=(torch.randn(1, 3, 4),))
    assert isinstance(by_call.embed, cg.SafeLinear)
    assert not isinstance(by_call.proj, cg.SafeLinear)


def test_replace_by_names_and_errors() -> None:
    model = cg.replace_linear(Encoder(), which=["embed"])
    assert isinstance(model.embed, cg.SafeLinear) and type(model.proj) is nn.Linear
    with pytest.raises(ValueError, match="not nn.Linear modules"):
        cg.replace_linear(Encoder(), which=["nope"])
    with pytest.raises(ValueError, match="which must be"):
        cg.replace_linear(Encoder(), which="some")
    with pytest.raises(ValueError, match="mode must be"):
        cg.replace_linear(Encoder(), mode="loud")


def test_replace_root_linear_returns_replacement() -> None:
    linear = nn.Linear(3, 2)
    safe = cg.replace_linear(linear)
    assert isinstance(safe, cg.SafeLinear) and safe.weight is linear.weight


def test_errors_name_the_qualified_layer() -> None:
    model = cg.replace_linear(nn.Sequential(Encoder(), nn.Linear(8, 2)))
    x = torch.randn(2, 5, 4)
    x[1, 2, 3] = float("nan")
    with pytest.raises(cg.NonFiniteInputError, match="layer '0.embed'"):
        model(x)


def test_name_layers_for_models_built_with_safelinear() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = cg.SafeLinear(3, 2)

    net = Net()
    assert "unnamed SafeLinear(3->2)" in net.head.guard_label
    cg.name_layers(net)
    assert net.head.guard_label == "head"
    with pytest.raises(cg.ShapeMismatchError, match="layer 'head'"):
        net.head(torch.randn(1, 4))


def test_works_with_no_grad_and_sequential(device: str) -> None:
    model = cg.replace_linear(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))).to(device)
    with torch.no_grad():
        y = model(torch.randn(5, 4, device=device))
    assert y.shape == (5, 1) and not y.requires_grad


# ---------------------------------------------------------------------------
# Aliases, reparametrized Linears, hooks, names, example inputs
# ---------------------------------------------------------------------------
def test_a_linear_registered_twice_is_swapped_in_every_slot() -> None:
    lin = nn.Linear(6, 6)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    x = torch.randn(3, 6)
    expected = model(x)
    cg.replace_linear(model)
    assert isinstance(model[0], cg.SafeLinear) and model[2] is model[0]
    assert model[0].guard_name == "0" and model[0].weight is lin.weight
    assert_matches(model(x), expected)
    for alias in ("0", "2"):
        again = nn.Sequential(lin, nn.ReLU(), lin)
        cg.replace_linear(again, which=[alias])
        assert isinstance(again[0], cg.SafeLinear) and again[2] is again[0]


def test_the_shared_linear_is_guarded_in_its_second_slot() -> None:
    lin = nn.Linear(6, 6)
    model = cg.replace_linear(nn.Sequential(lin, nn.ReLU(), lin))
    with torch.no_grad():
        model[0].weight.fill_(1e38)  # finite, but 6 * 1e38 overflows: Inf reaches slot 2
    with pytest.raises(cg.NonFiniteInputError, match="layer '0'") as info:
        model(torch.ones(2, 6))
    assert info.value.fields["role"] == "input"


def _hook_reparametrized() -> dict[str, nn.Linear]:
    import torch.nn.utils.prune as prune

    out = {
        "weight_norm": nn.utils.weight_norm(nn.Linear(8, 5)),
        "spectral_norm": nn.utils.spectral_norm(nn.Linear(8, 5)),
        "prune": prune.l1_unstructured(nn.Linear(8, 5), "weight", amount=0.3),
        "parametrize_weight_norm": nn.utils.parametrizations.weight_norm(nn.Linear(8, 5)),
        "parametrize_orthogonal": nn.utils.parametrizations.orthogonal(nn.Linear(8, 5)),
        "parametrize_spectral_norm": nn.utils.parametrizations.spectral_norm(nn.Linear(8, 5)),
    }
    return out


@pytest.mark.parametrize("kind", list(_hook_reparametrized()))
def test_reparametrized_linears_are_swapped_and_stay_reparametrized(kind: str) -> None:
    import warnings

    def build() -> nn.Module:  # twice, same seed: a hook-based weight_norm cannot be deep-copied
        torch.manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the hook-based ones
            return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), _hook_reparametrized()[kind])

    ref, model = build(), build()
    ref.eval(), model.eval()  # spectral_norm's power iteration runs in training only
    cg.replace_linear(model)
    assert isinstance(model[2], cg.SafeLinear) and isinstance(model[0], cg.SafeLinear)
    x = torch.randn(3, 4)
    assert_matches(model(x), ref(x))
    assert list(model.state_dict()) == list(ref.state_dict())
    # training moves the same parameters the reparametrization owns
    model.train(), ref.train()
    opt_m = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
    for _ in range(3):
        for net, opt in ((model, opt_m), (ref, opt_r)):
            opt.zero_grad()
            net(x).square().sum().backward()
            opt.step()
    model.eval(), ref.eval()
    assert_matches(model(x), ref(x), rel=1e-4)
    # and a NaN in what the weight is computed from is caught
    with torch.no_grad():
        # every element: some maps ignore part of their input (orthogonal's tril)
        next(p for n, p in model[2].named_parameters() if "weight" in n or "original" in n).fill_(NAN)
    with pytest.raises(cg.NonFiniteInputError, match="layer '2'"):
        model(x)


class _CountingScale(nn.Module):
    """A parametrization that counts how often the weight is computed."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return weight * 0.5


@pytest.mark.parametrize("entry", ["fast", "torch.ops"])
def test_a_parametrized_weight_is_computed_once_per_forward(entry: str, monkeypatch) -> None:
    """Both entries (the fast one, and the torch.ops path a JIT build or a torch function mode
    takes) read the weight once: spectral_norm's power iteration moves its buffers at each read."""
    import cublas_guard_ext.guarded_linear.ops as ops

    if entry == "torch.ops":
        monkeypatch.setattr(ops, "_fast_linear", None)  # what a JIT build has
    torch.manual_seed(3)
    layer = cg.SafeLinear(6, 4)
    nn.utils.parametrize.register_parametrization(layer, "weight", _CountingScale())
    counter = layer.parametrizations.weight[0]
    counter.calls = 0  # registering it computed the weight once, to check its shape
    x = torch.randn(5, 6)
    out = layer(x)
    assert counter.calls == 1
    assert_matches(
        out, torch.nn.functional.linear(x, layer.parametrizations.weight.original * 0.5, layer.bias)
    )

    # spectral_norm trained through the torch.ops entry stays bitwise nn.Linear's
    def build() -> nn.Module:
        torch.manual_seed(5)
        return nn.utils.parametrizations.spectral_norm(nn.Linear(8, 5))

    ref, model = build(), cg.replace_linear(build())
    x = torch.randn(3, 8)
    for net in (ref, model):
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        for _ in range(3):
            opt.zero_grad()
            net(x).square().sum().backward()
            opt.step()
    assert torch.equal(model.parametrizations.weight.original, ref.parametrizations.weight.original)
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), ref.buffers()))


def test_an_unswappable_linear_is_skipped_with_a_warning_and_nothing_is_half_swapped() -> None:
    wrapped = nn.Linear(4, 4)
    wrapped.forward = lambda x, _old=wrapped.forward: _old(x) * 2  # accelerate-style wrapper
    model = nn.Sequential(nn.Linear(4, 4), wrapped, nn.Linear(4, 2))
    with pytest.warns(
        UserWarning, match=r"left 1 matmul-bearing modules unguarded: 1 \(Linear\): its forward was replaced"
    ):
        cg.replace_linear(model)
    assert isinstance(model[0], cg.SafeLinear) and isinstance(model[2], cg.SafeLinear)
    assert type(model[1]) is nn.Linear
    # asked for by name: refused before anything is swapped
    model = nn.Sequential(nn.Linear(4, 4), wrapped, nn.Linear(4, 2))
    with pytest.raises(TypeError, match="cannot swap '1'"):
        cg.replace_linear(model, which=["0", "1", "2"])
    assert all(type(m) is nn.Linear for m in model)


def test_hooks_and_attributes_are_carried_over() -> None:
    lin = nn.Linear(4, 3)
    calls = []
    pre = lin.register_forward_pre_hook(lambda m, a: calls.append(("pre", type(m).__name__)))
    lin.register_forward_hook(lambda m, a, out: out * 2)
    lin.register_full_backward_hook(lambda m, gi, go: calls.append(("bwd", type(m).__name__)))
    lin._is_hf_initialized = True
    model = nn.Sequential(lin)
    x = torch.randn(2, 4, requires_grad=True)
    expected = model(x)
    calls.clear()
    cg.replace_linear(model)
    out = model(x)
    assert_matches(out, expected)  # the forward hook doubled it
    out.sum().backward()
    assert calls == [("pre", "SafeLinear"), ("bwd", "SafeLinear")]
    assert model[0]._is_hf_initialized is True
    pre.remove()  # the handle from before the swap still removes the hook
    calls.clear()
    model(x)
    assert calls == []


def test_names_given_by_hand_are_kept() -> None:
    model = nn.Sequential(cg.SafeLinear(4, 4, name="mine"), nn.Linear(4, 2))
    cg.replace_linear(model)
    assert model[0].guard_name == "mine" and model[1].guard_name == "1"
    outer = nn.Sequential(model)
    cg.name_layers(outer)  # names given automatically follow the new place
    assert model[0].guard_name == "mine" and model[1].guard_name == "0.1"


def test_first_called_by_example_changes_no_state_and_accepts_a_tensor() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    model.train()
    bn = model[1]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cg.replace_linear(model, which="first", example_inputs=torch.randn(8, 4) * 5 + 3)
    assert isinstance(model[0], cg.SafeLinear) and type(model[2]) is nn.Linear
    assert model.training and bn.training and model[0].training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed"
    with pytest.raises(TypeError, match="example_inputs must be a tensor or a tuple"):
        cg.replace_linear(nn.Sequential(nn.Linear(4, 2)), which="first", example_inputs=3)


def _transformer_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randn(3, 5, 16)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, 3:] = True  # padded tail: TransformerEncoder would use nested tensors
    return src, mask


@pytest.mark.parametrize("kind", ["layer", "encoder", "transformer"])
def test_transformer_fast_path_is_guarded(kind: str) -> None:
    torch.manual_seed(2)
    if kind == "layer":
        ref: nn.Module = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    elif kind == "encoder":
        ref = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True),
            2,
            enable_nested_tensor=True,
        )
    else:
        ref = nn.Transformer(16, 4, 1, 1, 32, dropout=0.0, batch_first=True)
    ref.eval()
    model = cg.replace_linear(copy.deepcopy(ref))
    src, mask = _transformer_inputs()

    def run(net: nn.Module) -> torch.Tensor:
        if kind == "transformer":
            return net(src, src[:, :4], src_key_padding_mask=mask, memory_key_padding_mask=mask)
        return net(src, src_key_padding_mask=mask)

    with torch.no_grad():
        expected, out = run(ref), run(model)
    keep = ~mask[..., None] if kind != "transformer" else torch.ones(1, dtype=torch.bool)
    # the fast path leaves padded positions unspecified (nested tensors give 0)
    assert_matches(torch.where(keep, out, 0.0), torch.where(keep, expected, 0.0), rel=1e-4)
    linear1 = next(m for n, m in model.named_modules() if n.endswith("linear1"))
    assert isinstance(linear1, cg.SafeLinear)
    with torch.no_grad():
        linear1.weight[0, 0] = NAN
        with pytest.raises(cg.NonFiniteInputError) as info:
            run(model)
    assert info.value.layer.endswith("linear1") and info.value.fields["role"] == "weight"
