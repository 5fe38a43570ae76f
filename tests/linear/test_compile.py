"""torch.compile, torch.export and torch.jit.script: every guard survives, shapes stay dynamic.

Each compiled guard must raise what eager raises: the same class, layer, role and
position. Graph counts are compared with nn.Linear's under the same settings.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn

import cublas_guard_ext as cg

from helpers import assert_matches

# Every test here compiles (Dynamo, Inductor, export, TorchScript): seconds each, and the first
# pays for importing the compiler stack.
pytestmark = pytest.mark.slow

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


# Also on the stable core: inside a compiled graph cg.check() reaches the core's op directly,
# and its payload error must come back typed (it once came back as a RuntimeError).
@pytest.mark.parametrize("backend", BACKENDS)
def test_check_inside_the_compiled_function_raises_like_eager(backend: str) -> None:
    # check() takes no tensor: traced as is, it ran once at trace time and left
    # the graph, so an async finding of the same graph was never raised.
    torch.manual_seed(1)
    first, second = cg.SafeLinear(8, 6, mode="async", name="c1"), cg.SafeLinear(6, 4, mode="async", name="c2")

    def f(x: torch.Tensor) -> torch.Tensor:
        h = first(x).relu()
        cg.check()
        return second(h) * 2

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    good = torch.randn(5, 8)
    assert_matches(compiled(good), f(good))
    cg.check()  # nothing pending
    for index in ((3, 1), (0, 0)):  # two calls of the same graph
        bad = torch.randn(5, 8)
        bad[index] = NAN
        got = _raised(compiled, bad)
        cg.check()  # raised inside the graph: nothing left pending
        assert _fields(got) == _fields(_raised(f, bad))
        assert got.layer == "c1" and got.first_bad_index == index[0] * 8 + index[1]


# ---------------------------------------------------------------------------
# 5. Dynamic shapes: no recompile per batch size beyond nn.Linear's own.
# ---------------------------------------------------------------------------
def _counting(inner: str = "aot_eager"):
    from torch._dynamo import lookup_backend

    compiled_graphs: list[int] = []
    backend = lookup_backend(inner)

    def count(gm, example_inputs):
        compiled_graphs.append(1)
        return backend(gm, example_inputs)

    return count, compiled_graphs


def _stack(factory) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(factory(8, 16), nn.ReLU(), factory(16, 4))


def _graph_count(model: nn.Module, sizes, dynamic, backward: bool = True, inner: str = "aot_eager") -> int:
    torch._dynamo.reset()
    backend, graphs = _counting(inner)
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, backend=backend)
    for n in sizes:
        x = torch.randn(n, 8, requires_grad=backward)
        out = compiled(x)
        assert_matches(out, model(x))
        if backward:
            out.sum().backward()
    return len(graphs)


BATCHES = [2, 3, 4, 5, 7, 9, 11, 13, 16, 17, 20, 31]  # more than the recompile limit (8)


@pytest.mark.parametrize("dynamic", [None, True])
def test_many_batch_sizes_compile_like_nn_linear(dynamic) -> None:
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        ref = _graph_count(_stack(nn.Linear), BATCHES, dynamic)
        got = _graph_count(_stack(lambda i, o: cg.SafeLinear(i, o, mode="sync")), BATCHES, dynamic)
    assert got == ref, (got, ref)
    assert got == (1 if dynamic else 2)  # automatic dynamic: static, then one dynamic graph


def test_dynamic_true_builds_one_graph_with_inductor() -> None:
    sizes = [2, 5, 9]
    got = _graph_count(_stack(lambda i, o: cg.SafeLinear(i, o)), sizes, True, inner="inductor")
    assert got == 1


# Also on the stable core, whose fake kernels run the argument rules on the traced example's
# sizes: a wrong in_features is named as such, not found by autograd's shape check.
def test_dynamic_graph_still_guards_every_batch_size() -> None:
    model = _stack(lambda i, o: cg.SafeLinear(i, o, mode="sync"))
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for n in (3, 6, 10):
        bad = torch.randn(n, 8)
        bad[n - 1, 7] = INF
        assert _fields(_raised(compiled, bad)) == _fields(_raised(model, bad))
    wrong = torch.randn(6, 7)  # the last dim is still checked (it is not dynamic)
    with pytest.raises(Exception, match="in_features"):  # dynamo wraps it (TorchRuntimeError)
        compiled(wrong)


def test_torch_export_with_a_dynamic_batch_dim() -> None:
    model = _stack(lambda i, o: cg.SafeLinear(i, o, mode="sync"))
    batch = torch.export.Dim("batch", min=2, max=1 << 20)
    exported = torch.export.export(model, (torch.randn(4, 8),), dynamic_shapes=({0: batch},))
    module = exported.module()
    for n in (2, 3, 17, 64):
        x = torch.randn(n, 8)
        assert_matches(module(x), model(x))
    bad = torch.randn(9, 8)
    bad[4, 4] = NAN
    assert _fields(_raised(module, bad)) == _fields(_raised(model, bad))


def test_torch_export_keeps_check_features() -> None:
    class Checked(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            cg.check_features(x, 8, "exported")
            return x + 1

    batch = torch.export.Dim("batch", min=2, max=1024)
    exported = torch.export.export(Checked(), (torch.randn(4, 8),), dynamic_shapes=({0: batch},))
    assert "check_features" in str(exported.graph)
    bad = torch.randn(7, 8)
    bad[6, 0] = NAN
    err = _raised(exported.module(), bad)
    assert err.layer == "exported" and err.first_bad_index == 48


# ---------------------------------------------------------------------------
# 10. torch.jit.script
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False])
def test_jit_script_matches_eager_and_differentiates(bias: bool) -> None:
    layer = cg.SafeLinear(8, 4, bias=bias, name="scripted")
    scripted = torch.jit.script(layer)
    x = torch.randn(2, 3, 8, requires_grad=True)
    out = scripted(x)
    assert_matches(out, layer(x))
    out.square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    layer(x).square().sum().backward()
    for g, w in zip(got, [x.grad] + [p.grad for p in layer.parameters()]):
        assert_matches(g, w)


@pytest.mark.parametrize("mode", ["off", "async"])
def test_jit_script_uses_the_layer_mode(mode: str) -> None:
    scripted = torch.jit.script(cg.SafeLinear(8, 4, mode=mode, name="m"))
    bad = torch.randn(2, 8)
    bad[0, 0] = NAN
    out = scripted(bad)  # neither mode raises in the call
    assert out[0].isnan().all() and not out[1].isnan().any()
    if mode == "async":
        with pytest.raises(cg.NonFiniteInputError, match="layer 'm'"):
            cg.check()
    else:
        cg.check()


def test_jit_script_cast_policy() -> None:
    layer = cg.SafeLinear(8, 4, dtype_policy="cast")
    x = torch.randn(3, 8).to(torch.bfloat16)
    out = torch.jit.script(layer)(x)
    assert out.dtype == torch.bfloat16
    assert_matches(out.float(), layer(x).float())
