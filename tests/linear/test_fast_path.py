"""The fast eager entry: the same op as torch.ops, the same results and errors.

``cublas_guard_ext.ops._fast_linear`` calls ``cublas_guard::linear`` through a
typed dispatcher handle (csrc/locked/python_module.cpp). It must agree with
``torch.ops.cublas_guard.linear.default`` bit for bit and error for error, and
hand every call it cannot take exactly like torch.ops back to that path (None).
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import cublas_guard_ext as cg
from cublas_guard_ext.guarded_linear import modes, ops
from cublas_guard_ext.guarded_linear import nn as cg_nn

pytestmark = pytest.mark.skipif(ops._fast_linear is None, reason="JIT build: no fast entry")

OP = torch.ops.cublas_guard.linear.default
MODE = {"off": 0, "sync": 1, "async": 2}


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 (compared below)
        return "raised", exc


def _same_outcome(fast, slow) -> None:
    kind_f, value_f = _outcome(fast)
    kind_s, value_s = _outcome(slow)
    assert kind_f == kind_s, (value_f, value_s)
    if kind_f == "ok":
        assert value_f.dtype == value_s.dtype and value_f.shape == value_s.shape
        assert torch.equal(value_f, value_s)
    else:
        assert type(value_f) is type(value_s)
        assert str(value_f) == str(value_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mode", ["off", "sync", "async"])
@pytest.mark.parametrize("shape", [(1, 16), (3, 2, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_fast_entry_matches_torch_ops(dtype, mode, shape, bias) -> None:
    x = torch.randn(*shape, dtype=dtype)
    w = torch.randn(5, 16, dtype=dtype)
    b = torch.randn(5, dtype=dtype) if bias else None
    out = ops._fast_linear(x, w, b, "fast", MODE[mode], False)
    assert out is not None
    assert torch.equal(out, OP(x, w, b, "fast", MODE[mode], False))
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def _poisoned(n: int = 16) -> torch.Tensor:
    x = torch.randn(2, n)
    x[1, 3] = float("nan")
    return x


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(lambda: (_poisoned(), torch.randn(5, 16), None, "bad", 1, False), id="nonfinite-sync"),
        pytest.param(lambda: (torch.randn(2, 15), torch.randn(5, 16), None, "bad", 1, False), id="shape"),
        pytest.param(
            lambda: (torch.randn(2, 16).double(), torch.randn(5, 16), None, "bad", 1, False),
            id="dtype-mismatch",
        ),
        pytest.param(
            lambda: (torch.randn(2, 16), torch.randn(5, 16), torch.randn(4), "bad", 1, False), id="bias-shape"
        ),
        pytest.param(
            lambda: (torch.randn(2, 16).int(), torch.randn(5, 16).int(), None, "bad", 0, False),
            id="int-dtype",
        ),
        pytest.param(lambda: (torch.randn(2, 16), torch.randn(5, 16), None, "bad", 7, False), id="mode-code"),
        pytest.param(
            lambda: (torch.randn(2, 16), torch.randn(5, 16, 1), None, "bad", 0, False), id="weight-dims"
        ),
    ],
)
def test_fast_entry_raises_what_torch_ops_raises(args) -> None:
    a = args()
    _same_outcome(lambda: ops._fast_linear(*a), lambda: OP(*a))


def test_fast_entry_async_finding_is_raised_like_torch_ops() -> None:
    w = torch.randn(5, 16)
    assert ops._fast_linear(_poisoned(), w, None, "fast-async", 2, False) is not None
    with pytest.raises(cg.NonFiniteInputError) as fast:
        cg.check()
    OP(_poisoned(), w, None, "fast-async", 2, False)
    with pytest.raises(cg.NonFiniteInputError) as slow:
        cg.check()
    assert "fast-async" in str(fast.value) and "fast-async" in str(slow.value)
    assert fast.value.fields["call"] + 1 == slow.value.fields["call"]  # one counter, whichever entry


class _Seen(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.funcs: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


class _Sub(torch.Tensor):
    pass


def test_fast_entry_declines_what_torch_ops_treats_differently() -> None:
    x, w, b = torch.randn(2, 16), torch.randn(5, 16), torch.randn(5)
    assert ops._fast_linear(x.to_sparse(), w, b, "l", 0, False) is None
    assert ops._fast_linear(x.as_subclass(_Sub), w, b, "l", 0, False) is None
    assert ops._fast_linear(x, w, b, "l", 0, 1) is None  # scan_grad not a bool
    assert ops._fast_linear(x, w, b, 3, 0, False) is None  # layer not a str
    assert ops._fast_linear(x, w, b, "l", "off", False) is None
    assert ops._fast_linear(x, w, b, "l", 2**70, False) is None
    assert ops._fast_linear([1.0], w, b, "l", 0, False) is None
    assert ops._fast_linear(x, w, b, "l", 0) is None  # wrong arity
    with _Seen():
        assert ops._fast_linear(x, w, b, "l", 0, False) is None


def test_safelinear_takes_the_fast_entry_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = cg_nn._fast_linear

    def counting(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cg_nn, "_fast_linear", counting)
    layer = cg.SafeLinear(16, 5, mode="off", name="fast.layer")
    x = torch.randn(3, 16)
    with torch.no_grad():
        out = layer(x)
    assert calls == [True]
    torch.testing.assert_close(
        out, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-6, atol=1e-6
    )
    # A torch function mode sees the call on the torch.ops path, as it sees any op.
    seen = _Seen()
    with seen, torch.no_grad():
        torch.testing.assert_close(layer(x), out, rtol=0, atol=0)
    assert calls == [True, False]
    assert torch.ops.cublas_guard.linear.default in seen.funcs
    # dtype_policy="cast" never takes it.
    with pytest.warns(FutureWarning):
        cast = cg.SafeLinear(16, 5, dtype_policy="cast")
    cast(torch.randn(2, 16, dtype=torch.bfloat16))
    assert calls == [True, False]


def test_default_mode_follows_the_environment_as_it_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = cg.SafeLinear(16, 5, name="fast.env")
    monkeypatch.setenv(modes.ENV_VAR, "off")
    layer(_poisoned())  # off: passes
    monkeypatch.setenv(modes.ENV_VAR, " SYNC ")
    with pytest.raises(cg.NonFiniteInputError):
        layer(_poisoned())
    monkeypatch.setenv(modes.ENV_VAR, "Async")
    layer(_poisoned())  # recorded, raised later
    with pytest.raises(cg.NonFiniteInputError, match="fast.env"):
        cg.check()
    monkeypatch.setenv(modes.ENV_VAR, "")
    with pytest.raises(cg.NonFiniteInputError):
        layer(_poisoned())
    monkeypatch.delenv(modes.ENV_VAR)
    with pytest.raises(cg.NonFiniteInputError):
        layer(_poisoned())
    monkeypatch.setenv(modes.ENV_VAR, "\u00a0off")  # not ASCII: the Python path decides (str.strip)
    layer(_poisoned())
    monkeypatch.setenv(modes.ENV_VAR, "paranoid")
    with pytest.raises(ValueError, match="CUBLAS_GUARD_MODE='paranoid' is not a mode"):
        layer(torch.randn(2, 16))
    monkeypatch.setenv(modes.ENV_VAR, "off")
    with cg.guard("sync", check_on_exit=False):
        with pytest.raises(cg.NonFiniteInputError):
            layer(_poisoned())


def test_no_autograd_node_without_gradients_and_the_same_gradients_with() -> None:
    layer = cg.SafeLinear(16, 5, name="fast.grad")
    ref = torch.nn.Linear(16, 5)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert layer(x).grad_fn is None
    frozen = layer(x.clone())  # parameters require grad: a node
    assert frozen.grad_fn is not None
    xg = x.clone().requires_grad_()
    g = torch.randn(4, 5)
    got = torch.autograd.grad(layer(xg), (xg, layer.weight, layer.bias), g)
    want = torch.autograd.grad(ref(xg), (xg, ref.weight, ref.bias), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for p in layer.parameters():
        p.requires_grad_(False)
    assert layer(x).grad_fn is None and not layer(x).requires_grad


def test_forward_ad_on_the_op_is_refused_with_torchs_jvp_error() -> None:
    import torch.autograd.forward_ad as fwAD

    w, b = torch.randn(5, 16), torch.randn(5)
    for ctx in (torch.no_grad, torch.enable_grad):
        with fwAD.dual_level(), ctx():
            xd = fwAD.make_dual(torch.randn(2, 16), torch.randn(2, 16))
            with pytest.raises(RuntimeError, match="jvp is not implemented"):
                OP(xd, w, b, "l", 1, False)
