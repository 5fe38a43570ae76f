"""What backward keeps alive: only what the needed gradients read, like nn.Linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cublas_guard_ext as cg

from helpers import assert_matches


def _saved_bytes(run) -> int:
    """Bytes of distinct tensors autograd saves while `run()` builds its graph."""
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        seen[key] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    out.sum().backward()
    return sum(seen.values())


def _stack(factory, frozen: bool) -> nn.Module:
    torch.manual_seed(2)
    model = nn.Sequential(*[factory(256, 256) for _ in range(6)])
    model.requires_grad_(not frozen)
    return model


@pytest.mark.parametrize("case", ["frozen", "trained_no_input_grad", "trained"])
def test_saved_bytes_are_no_more_than_nn_linear(case: str) -> None:
    frozen = case == "frozen"
    x = torch.randn(128, 256, requires_grad=case != "trained_no_input_grad")
    ref = _saved_bytes(lambda: _stack(nn.Linear, frozen)(x))
    got = _saved_bytes(lambda: _stack(cg.SafeLinear, frozen)(x))
    assert got <= ref, (got, ref)
    if frozen:
        # Six frozen layers read only their weights (256*256 float32 each), no activation.
        assert got == 6 * 256 * 256 * 4


def test_frozen_layer_input_edited_in_place_then_backward() -> None:
    grads = []
    for factory in (nn.Linear, cg.SafeLinear):
        torch.manual_seed(4)
        layer = factory(8, 4).requires_grad_(False)
        leaf = torch.randn(3, 8, requires_grad=True)
        h = leaf * 2
        out = layer(h)
        h.add_(1.0)  # nn.Linear allows it: a frozen layer does not read its input in backward
        out.square().sum().backward()
        grads.append(leaf.grad)
    assert_matches(grads[1], grads[0])


@pytest.mark.parametrize("input_grad", [False, True])
def test_parameters_made_under_inference_mode(input_grad: bool) -> None:
    outcomes = []
    for factory in (nn.Linear, cg.SafeLinear):
        torch.manual_seed(5)
        with torch.inference_mode():
            layer = factory(8, 4)
        x = torch.randn(3, 8, requires_grad=input_grad)
        try:
            out = layer(x)
            result = ("ok", out.detach().clone(), out.requires_grad)
            if out.requires_grad:
                out.sum().backward()
                result += (None if x.grad is None else x.grad.clone(),)
        except RuntimeError as e:
            result = ("error", "Inference tensors cannot be saved for backward" in str(e))
        outcomes.append(result)
    want, got = outcomes
    assert got[0] == want[0], (got, want)
    if want[0] == "ok":
        assert_matches(got[1], want[1])
        assert got[2:3] == want[2:3] and len(got) == len(want)
        if len(want) > 3:
            assert (got[3] is None) == (want[3] is None)
            if want[3] is not None:
                assert_matches(got[3], want[3])

    else:
        assert got[1] and want[1]


@pytest.mark.parametrize("shape", [(3, 8), (2, 3, 8), (8,)])
def test_inference_mode_parameters_get_nn_linears_grads(shape) -> None:
    # nn.Linear reads the weight through weight.t(), which outside inference mode
    # does not track an inference tensor: weight.grad stays None, bias.grad is filled.
    grads = []
    for factory in (nn.Linear, cg.SafeLinear):
        torch.manual_seed(7)
        with torch.inference_mode():
            layer = factory(8, 4)
        x = torch.randn(shape)
        out = layer(x)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(8))).sum().backward()
        grads.append({k: p.grad for k, p in layer.named_parameters()})
    want, got = grads
    assert want["weight"] is None and want["bias"] is not None  # the behaviour being mirrored
    assert got.keys() == want.keys()
    for k in want:
        assert (got[k] is None) == (want[k] is None), k
        if want[k] is not None:
            assert_matches(got[k], want[k])


def test_double_backward_through_a_layer_that_saved_little() -> None:
    """x needs no grad, W does: x is saved, W is not; dW's own derivative still works."""
    for factory in (nn.Linear, cg.SafeLinear):
        torch.manual_seed(6)
        layer = factory(8, 4)
        x = torch.randn(3, 8)
        (gw,) = torch.autograd.grad(layer(x).tanh().sum(), layer.weight, create_graph=True)
        (hw,) = torch.autograd.grad(gw.square().sum(), layer.weight)
        if factory is nn.Linear:
            want = (gw.detach(), hw)
        else:
            assert_matches(gw.detach(), want[0])
            assert_matches(hw, want[1], 1e-4)
