"""torch.func transforms and forward-mode AD, against nn.Linear (float32, TF32 off).

SafeLinear differentiates through C++ autograd nodes in eager; under a
transform it takes the Python autograd path (cublas_guard_ext/_transforms.py),
which must give nn.Linear's results and keep every guard.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import cublas_guard_ext as cg

from helpers import assert_matches

NAN = float("nan")
INF = float("inf")
REL = 1e-5  # float32 results of the same math in another order


def _pair(bias: bool = True, mode: str = "sync", scan_grad: bool = False):
    """A SafeLinear and an nn.Linear with the same parameters."""
    ref = nn.Linear(8, 4, bias=bias)
    return cg.SafeLinear.from_linear(ref, mode=mode, name="f", scan_grad=scan_grad), ref


def _stacks():
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))
    safe = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))
    safe.load_state_dict(ref.state_dict())
    return cg.replace_linear(safe), ref


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


def _assert_tree(got, want, rel=REL) -> None:
    if isinstance(got, dict):
        assert got.keys() == want.keys()
        for k in got:
            _assert_tree(got[k], want[k], rel)
    elif isinstance(got, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_tree(g, w, rel)
    else:
        assert_matches(got, want, rel)


def _loss(model):
    def loss(params, x, y):
        return (functional_call(model, params, (x,)) - y).square().sum()

    return loss


@pytest.mark.parametrize("bias", [True, False])
def test_grad_matches_nn_linear(bias: bool) -> None:
    safe, ref = _pair(bias)
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    _assert_tree(grad(_loss(safe))(_params(safe), x, y), grad(_loss(ref))(_params(ref), x, y))
    # and with respect to the input
    f = lambda m: lambda x: m(x).sin().sum()  # noqa: E731
    _assert_tree(grad(f(safe))(x), grad(f(ref))(x))


def test_vjp_matches_nn_linear() -> None:
    safe, ref = _stacks()
    x, cot = torch.randn(2, 5, 8), torch.randn(2, 5, 3)
    out_s, fn_s = vjp(safe, x)
    out_r, fn_r = vjp(ref, x)
    assert_matches(out_s, out_r)
    _assert_tree(fn_s(cot), fn_r(cot))


def test_jacrev_and_jacfwd_match_nn_linear() -> None:
    safe, ref = _stacks()
    x = torch.randn(3, 8)
    _assert_tree(jacrev(safe)(x), jacrev(ref)(x))
    _assert_tree(jacfwd(safe)(x), jacfwd(ref)(x))
    # with respect to every parameter
    params_s, params_r = _params(safe), _params(ref)
    call_s = lambda p: functional_call(safe, p, (x,))  # noqa: E731
    call_r = lambda p: functional_call(ref, p, (x,))  # noqa: E731
    _assert_tree(jacrev(call_s)(params_s), jacrev(call_r)(params_r))
    _assert_tree(jacfwd(call_s)(params_s), jacfwd(call_r)(params_r))


def test_jvp_matches_nn_linear() -> None:
    safe, ref = _stacks()
    x, t = torch.randn(4, 8), torch.randn(4, 8)
    _assert_tree(jvp(safe, (x,), (t,)), jvp(ref, (x,), (t,)))
    # tangents on the parameters (weight and bias at once)
    tangents = {k: torch.randn_like(v) for k, v in _params(ref).items()}
    call_s = lambda p: functional_call(safe, p, (x,))  # noqa: E731
    call_r = lambda p: functional_call(ref, p, (x,))  # noqa: E731
    _assert_tree(jvp(call_s, (_params(safe),), (tangents,)), jvp(call_r, (_params(ref),), (tangents,)))


@pytest.mark.parametrize("batch_shape", [(), (3,)])
def test_per_sample_gradients_match_nn_linear(batch_shape) -> None:
    """vmap over grad: the differentially private training recipe."""
    safe, ref = _stacks()
    xs, ys = torch.randn(6, *batch_shape, 8), torch.randn(6, *batch_shape, 3)

    def per_sample(model):
        loss = _loss(model)
        return vmap(grad(loss), in_dims=(None, 0, 0))(_params(model), xs, ys)

    got, want = per_sample(safe), per_sample(ref)
    _assert_tree(got, want)
    assert got["0.weight"].shape == (6, 6, 8)


def test_vmap_forward_and_model_ensembles_match_nn_linear() -> None:
    safe, ref = _stacks()
    xs = torch.randn(5, 8)
    assert_matches(vmap(safe)(xs), ref(xs))  # per-sample 1-D inputs
    # an ensemble of 4 models: stacked parameters, vmapped together with (or without) inputs
    members = [_stacks() for _ in range(4)]
    for s, r in members:
        for p in r.parameters():
            p.data.normal_()
        s.load_state_dict(r.state_dict())
    stacked_s = {k: torch.stack([_params(s)[k] for s, _ in members]) for k in _params(safe)}
    stacked_r = {k: torch.stack([_params(r)[k] for _, r in members]) for k in _params(ref)}
    shared_x = torch.randn(3, 8)
    each_x = torch.randn(4, 3, 8)
    for in_dims, x in (((0, None), shared_x), ((0, 0), each_x)):
        got = vmap(lambda p, x: functional_call(safe, p, (x,)), in_dims=in_dims)(stacked_s, x)
        want = vmap(lambda p, x: functional_call(ref, p, (x,)), in_dims=in_dims)(stacked_r, x)
        assert_matches(got, want)
        # and the ensemble's parameter gradients through vmap
        loss_s = lambda p, x: functional_call(safe, p, (x,)).square().sum()  # noqa: E731
        loss_r = lambda p, x: functional_call(ref, p, (x,)).square().sum()  # noqa: E731
        _assert_tree(
            vmap(grad(loss_s), in_dims=in_dims)(stacked_s, x),
            vmap(grad(loss_r), in_dims=in_dims)(stacked_r, x),
        )


def test_forward_ad_matches_nn_linear() -> None:
    safe, ref = _stacks()
    x, t = torch.randn(4, 8), torch.randn(4, 8)
    results = []
    for model in (safe, ref):
        with fwAD.dual_level():
            out = model(fwAD.make_dual(x, t))
            primal, tangent = fwAD.unpack_dual(out)
            results.append((primal.clone(), tangent.clone()))
    _assert_tree(results[0], results[1])


def test_forward_ad_with_parameter_tangents() -> None:
    safe, ref = _pair()
    x = torch.randn(4, 8)
    tw, tb = torch.randn(4, 8), torch.randn(4)
    results = []
    for model in (safe, ref):
        with fwAD.dual_level():
            params = {
                "weight": fwAD.make_dual(model.weight.detach(), tw),
                "bias": fwAD.make_dual(model.bias.detach(), tb),
            }
            results.append(fwAD.unpack_dual(functional_call(model, params, (x,))).tangent.clone())
    assert_matches(results[0], results[1])


# ---------------------------------------------------------------------------
# Guards on the transform path: the same typed errors as eager.
# ---------------------------------------------------------------------------
def _poisoned(shape, flat_index, value=NAN) -> torch.Tensor:
    x = torch.randn(shape)
    x.view(-1)[flat_index] = value
    return x


def test_grad_and_jvp_raise_on_bad_input() -> None:
    safe, _ = _pair()
    bad = _poisoned((5, 8), 11)
    for run in (
        lambda: grad(lambda x: safe(x).sum())(bad),
        lambda: jvp(safe, (bad,), (torch.randn(5, 8),)),
        lambda: jacrev(safe)(bad),
    ):
        with pytest.raises(cg.NonFiniteInputError) as info:
            run()
        assert info.value.layer == "f" and info.value.role == "input"
        assert info.value.first_bad_index == 11


def test_forward_ad_raises_on_bad_weight() -> None:
    safe, _ = _pair()
    with torch.no_grad():
        safe.weight[2, 3] = INF
    with fwAD.dual_level(), pytest.raises(cg.NonFiniteInputError) as info:
        safe(fwAD.make_dual(torch.randn(3, 8), torch.randn(3, 8)))
    assert info.value.role == "weight" and info.value.first_bad_coords == [2, 3]


def test_per_sample_gradients_raise_on_one_bad_sample() -> None:
    safe, _ = _pair()
    xs, ys = torch.randn(6, 8), torch.randn(6, 4)
    xs[4, 2] = NAN
    with pytest.raises(cg.NonFiniteInputError) as info:
        vmap(grad(_loss(safe)), in_dims=(None, 0, 0))(_params(safe), xs, ys)
    assert info.value.layer == "f" and info.value.first_bad_index == 4 * 8 + 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_scan_grad_under_vjp(mode: str) -> None:
    safe, _ = _pair(mode=mode, scan_grad=True)
    out, fn = vjp(safe, torch.randn(3, 8))
    fn(torch.randn_like(out))  # a clean cotangent passes
    cot = torch.randn_like(out)
    cot[2, 1] = INF
    with pytest.raises(cg.NonFiniteInputError) as info:
        fn(cot)
        cg.check()
    assert info.value.role == "grad_output" and info.value.first_bad_coords == [2, 1]


def test_vmap_refuses_a_wrong_feature_dim() -> None:
    safe, _ = _pair()
    with pytest.raises(cg.ShapeMismatchError, match="in_features"):
        vmap(safe)(torch.randn(5, 7))


@pytest.mark.locked
def test_eager_path_is_untouched_outside_transforms() -> None:
    """Outside transforms the op records its C++ node, not the Python Function."""
    safe, _ = _pair()
    out = safe(torch.randn(2, 8, requires_grad=True))
    assert "CppFunction" in type(out.grad_fn).__name__ or "LinearFunction" in type(out.grad_fn).__name__
    with fwAD.dual_level():
        dual = safe(fwAD.make_dual(torch.randn(2, 8), torch.randn(2, 8)))
    assert "_Linear" in type(dual.grad_fn).__name__ or dual.grad_fn is None


def _hessian_stacks():
    torch.manual_seed(6)
    ref = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    safe = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    safe.load_state_dict(ref.state_dict())
    return cg.replace_linear(safe), ref


def test_hessian_matches_nn_linear() -> None:
    # jacfwd over jacrev: the Functions' forward replays under two vmap levels.
    safe, ref = _hessian_stacks()
    f = lambda m: lambda x: m(x).sin().sum()  # noqa: E731
    x = torch.randn(3, 4)
    got, want = hessian(f(safe))(x), hessian(f(ref))(x)
    assert got.shape == (3, 4, 3, 4) and want.abs().max() > 1e-3
    assert_matches(got, want, REL)
    # with respect to the parameters, and of a vector output (jacfwd(jacrev))
    call_s = lambda p: functional_call(safe, p, (x,)).tanh().sum()  # noqa: E731
    call_r = lambda p: functional_call(ref, p, (x,)).tanh().sum()  # noqa: E731
    _assert_tree(hessian(call_s)(_params(safe)), hessian(call_r)(_params(ref)))
    _assert_tree(jacfwd(jacrev(safe))(x[0]), jacfwd(jacrev(ref))(x[0]))


def test_hessian_keeps_the_input_guard() -> None:
    safe, _ = _hessian_stacks()
    x = _poisoned((3, 4), 5)
    with pytest.raises(cg.NonFiniteInputError) as info:
        hessian(lambda x: safe(x).sum())(x)
    assert info.value.layer == "0" and info.value.first_bad_index == 5
