"""torch.compile: every guard survives compilation.

Each compiled guard must raise what eager raises: the same class, layer, role and
position.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn

import cublas_guard_ext as cg
from conftest import assert_matches

NAN = float("nan")
INF = float("inf")
BACKENDS = ["aot_eager", "inductor"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _fields(err: cg.NonFiniteInputError) -> tuple:
    return (type(err), err.layer, err.role, err.first_bad_index, err.nan_count, err.posinf_count)


def _raised(fn, *args, check: bool = False) -> cg.NonFiniteInputError:
    with pytest.raises(cg.NonFiniteInputError) as info:
        fn(*args)
        if check:
            cg.check()
    return info.value


# ---------------------------------------------------------------------------
# 1. Guards that return nothing must not be eliminated as dead code.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_check_features_compiled_raises_like_eager(backend: str) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        cg.check_features(x, 8, "feat")
        return x * 2

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    good = torch.randn(3, 8)
    assert_matches(compiled(good), good * 2)
    bad = torch.randn(3, 8)
    bad[1, 2] = NAN
    assert _fields(_raised(compiled, bad)) == _fields(_raised(f, bad))
    inf = torch.randn(3, 8)
    inf[0, 0] = INF  # a second call of the same graph (no recompile): still checked
    assert _fields(_raised(compiled, inf)) == _fields(_raised(f, inf))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_compiled_forward_guard_raises_like_eager(backend: str, mode: str) -> None:
    model = cg.replace_linear(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), mode=mode)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(5, 8, requires_grad=True)
    assert_matches(compiled(x), model(x))
    bad = torch.randn(5, 8)
    bad[3, 1] = NAN
    sync_ = mode == "async"
    assert _fields(_raised(compiled, bad, check=sync_)) == _fields(_raised(model, bad, check=sync_))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_compiled_scan_grad_raises_like_eager_in_backward(backend: str, mode: str) -> None:
    torch.manual_seed(0)
    model = cg.replace_linear(
        nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)), mode=mode, scan_grad=True
    )
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(5, 8, requires_grad=True)

    def backward_with(run, grad: torch.Tensor) -> None:
        out = run(x)
        out.backward(grad)
        if mode == "async":
            cg.check()

    clean = torch.randn(5, 4)
    backward_with(compiled, clean)  # compiles forward and backward; clean gradients pass
    got_grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    backward_with(model, clean)
    for got, want in zip(got_grads, [x.grad] + [p.grad for p in model.parameters()]):
        assert_matches(got, want)
    bad = torch.randn(5, 4)
    bad[1, 3] = INF
    with pytest.raises(cg.NonFiniteInputError) as compiled_err:
        backward_with(compiled, bad)
    with pytest.raises(cg.NonFiniteInputError) as eager_err:
        backward_with(model, bad)
    assert _fields(compiled_err.value) == _fields(eager_err.value)
    assert compiled_err.value.role == "grad_output" and compiled_err.value.layer == "2"
