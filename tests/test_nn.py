"""SafeLinear as a drop-in nn.Linear, and the helpers that swap it in."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import cublas_guard_ext as cg
from conftest import assert_matches


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
