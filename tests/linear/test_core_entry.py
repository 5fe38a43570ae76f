"""The stable core's two fast entries take the same decisions.

Under the core, SafeLinear's hot call goes through ``seam().fast_linear``: the C entry
(csrc/python_entry_stable.cpp) where torch has the stable ABI's Python interop shims (2.14 on),
else its Python twin (core_twins/stable_core.py's ``fast_linear``). The C entry calls the op's
kernel without the dispatcher, so it must decline (None) every call where the dispatcher would
do something else, and raise the typed errors the twin raises. Each test runs on every entry
this torch has; test_fast_path.py runs the loaded entry against torch.ops.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import cublas_guard_ext as cg
from cublas_guard_ext._native.core_twins import stable_core
from cublas_guard_ext._native.loading import loader, seam

pytestmark = pytest.mark.skipif(
    loader.info().library != "core", reason="the stable core's entries (the locked library is loaded)"
)

OFF, SYNC = 0, 1
SHIMS = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)


def _entries() -> list:
    params = [pytest.param(stable_core.fast_linear, id="python")]
    if loader.info().library == "core":
        c = stable_core.c_entry(loader.info().path)
        if c is not None:
            params.append(pytest.param(c[0], id="c"))
    return params


ENTRIES = _entries()


def test_the_c_entry_serves_where_torch_has_the_shims() -> None:
    entry = seam.seam().fast_linear
    assert isinstance(entry, types.BuiltinFunctionType) is SHIMS, (torch.__version__, entry)
    assert (len(ENTRIES) == 2) is SHIMS


def test_the_python_twin_serves_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_GUARD_EXT_CORE_ENTRY", "python")
    assert stable_core.c_entry(loader.info().path) is None
    assert stable_core.c_entry("/nonexistent/library.so") is None  # no library: no C entry


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_results_match_float64_and_no_node_without_gradients(entry, dtype) -> None:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(3, 2, 16, generator=gen).to(dtype)
    w = torch.nn.Parameter(torch.randn(5, 16, generator=gen).to(dtype))
    b = torch.randn(5, generator=gen).to(dtype)
    with torch.no_grad():
        out = entry(x, w, b, "entry", SYNC, False)
    assert out is not None and out.grad_fn is None and type(out) is torch.Tensor
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    out = entry(x, w.detach(), None, "entry", OFF, False)  # grad mode on, nothing requires grad
    assert out is not None and out.grad_fn is None and not out.requires_grad


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_gradient_to_record_gets_the_autograd_node(entry) -> None:
    gen = torch.Generator().manual_seed(99)
    x = torch.randn(4, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    out = entry(x, w, b, "entry.grad", SYNC, True)
    assert out.grad_fn is not None
    g = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (x, w, b), g)
    want = torch.autograd.grad(torch.nn.functional.linear(x, w, b), (x, w, b), g)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    # scan_grad: a NaN gradient is refused in the backward, naming the layer.
    bad = g.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(cg.NonFiniteInputError, match="entry.grad"):
        entry(x, w, b, "entry.grad", SYNC, True).backward(bad)


@pytest.mark.parametrize("entry", ENTRIES)
def test_an_inference_weight_gets_no_gradient_outside_inference_mode(entry) -> None:
    with torch.inference_mode():
        w = torch.nn.Parameter(torch.randn(5, 16))  # as a layer made under inference mode has
    b = torch.randn(5, requires_grad=True)
    out = entry(torch.randn(2, 16), w, b, "entry.inf", OFF, False)
    out.sum().backward()
    assert w.grad is None and b.grad is not None


def _poisoned() -> torch.Tensor:
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(7))
    x[1, 3] = float("nan")
    return x


@pytest.mark.parametrize("entry", ENTRIES)
def test_the_typed_errors_of_the_torch_ops_path(entry) -> None:
    w = torch.randn(5, 16)
    with pytest.raises(cg.NonFiniteInputError) as found:
        entry(_poisoned(), w, None, "entry.bad", SYNC, False)
    assert found.value.fields["layer"] == "entry.bad" and found.value.fields["first_bad_index"] == 19
    with pytest.raises(ValueError) as shape:
        entry(torch.randn(2, 15), w, None, "entry.bad", SYNC, False)
    assert "entry.bad" in str(shape.value)
    with pytest.raises(ValueError, match="mode"):
        entry(torch.randn(2, 16), w, None, "entry.bad", 7, False)
    with pytest.raises(cg.DTypeError) as dtype:
        entry(torch.randn(2, 16).int(), w.int(), None, "entry.bad", OFF, False)
    assert isinstance(dtype.value, TypeError) and dtype.value.fields["layer"] == "entry.bad"


class _CountingDispatch(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("entry", ENTRIES)
def test_declines_what_the_dispatcher_must_see(entry) -> None:
    x, w, b = torch.randn(2, 16), torch.randn(5, 16), torch.randn(5)
    declined = [
        (x.to_sparse(), w, b, "l", OFF, False),
        (x.as_subclass(_Sub), w, b, "l", OFF, False),
        (x, w.as_subclass(_Sub), b, "l", OFF, False),
        (x, w, b.as_subclass(_Sub), "l", OFF, False),
        (x.to("meta"), w.to("meta"), b.to("meta"), "l", OFF, False),
        (x, w, b, "l", OFF, 1),
        (x, w, b, "l", True, False),  # a bool is not a mode code
        (x, w, b, 3, OFF, False),
        (x, w, b, "l", -1, False),
        (x, w, b, "l", 2**70, False),
        (x, w, b, "l", OFF),
    ]
    for args in declined:
        assert entry(*args) is None, args
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert entry(x, w, b, "l", OFF, False) is None
    with _Seen():
        assert entry(x, w, b, "l", OFF, False) is None
    seen_in_trace = []

    def traced(t: torch.Tensor) -> torch.Tensor:
        seen_in_trace.append(entry(t, w, b, "l", OFF, False))
        return t * 2

    torch.jit.trace(traced, x, check_trace=False)
    assert seen_in_trace == [None]
    assert entry(x, w, b, "l", OFF, False) is not None  # and taken again after each


class _Seen(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_the_c_entry_declines_under_a_dispatch_mode() -> None:
    """A TorchDispatchMode must see cublas_guard.linear (the twin's dispatcher call shows it
    the op; the C entry, which would skip the dispatcher, hands the call back)."""
    if len(ENTRIES) < 2:
        pytest.skip("torch < 2.14: no C entry")
    c = ENTRIES[1].values[0]
    x, w = torch.randn(2, 16), torch.randn(5, 16)
    mode = _CountingDispatch()
    with mode:
        assert c(x, w, None, "l", OFF, False) is None
    twin = _CountingDispatch()
    with twin:
        assert stable_core.fast_linear(x, w, None, "l", OFF, False) is not None
    assert torch.ops.cublas_guard.linear.default in twin.ops


def test_the_c_entry_marks_cuda_devices_and_checks_its_argument() -> None:
    if len(ENTRIES) < 2:
        pytest.skip("torch < 2.14: no C entry")
    _, first_use = stable_core.c_entry(loader.info().path)
    first_use(70)  # out of the mask's range: ignored, as the locked entry does
    with pytest.raises(TypeError):
        first_use("cuda:0")


def test_the_c_entry_releases_the_gil_and_serves_threads() -> None:
    """Four threads, each its own layer and inputs: every result is its own (the kernel runs
    with the GIL released, as torch.ops runs it)."""
    import threading

    entry = ENTRIES[-1].values[0]
    results: dict[int, bool] = {}

    def work(i: int) -> None:
        gen = torch.Generator().manual_seed(i)
        x, w = torch.randn(8, 32, generator=gen), torch.randn(16, 32, generator=gen)
        ok = True
        for _ in range(200):
            with torch.no_grad():
                out = entry(x, w, None, f"thread{i}", SYNC, False)
            ok &= torch.allclose(out, x @ w.t(), rtol=1e-5, atol=1e-5)
        results[i] = ok

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: True, 1: True, 2: True, 3: True}


@pytest.mark.parametrize("entry", ENTRIES)
def test_no_reference_is_kept_or_lost_on_any_path(entry) -> None:
    """Every path of the entry (a result, a declined call, a typed error, the autograd node)
    leaves its arguments' reference counts as it found them."""
    import gc

    x, w, b = torch.randn(2, 16), torch.randn(5, 16), torch.randn(5)
    layer, bad, wide = "entry.refs", _poisoned(), torch.randn(2, 15)
    wg = torch.randn(5, 16, requires_grad=True)
    before = [sys.getrefcount(o) for o in (x, w, b, layer, bad, wide, wg)]
    for _ in range(300):
        with torch.no_grad():
            assert entry(x, w, b, layer, SYNC, False) is not None
        assert entry(x.as_subclass(_Sub), w, b, layer, OFF, False) is None
        with pytest.raises(cg.NonFiniteInputError):
            entry(bad, w, None, layer, SYNC, False)
        with pytest.raises(ValueError):
            entry(wide, w, None, layer, SYNC, False)
        entry(x, wg, b, layer, OFF, False).sum().backward()
    gc.collect()
    assert [sys.getrefcount(o) for o in (x, w, b, layer, bad, wide, wg)] == before


def _direct_kernels():
    if len(ENTRIES) < 2:
        pytest.skip("torch < 2.14: no C entry")
    return stable_core._direct


def test_the_gradient_kernels_from_c_match_the_ops_below_autograd() -> None:
    direct = _direct_kernels()
    gen = torch.Generator().manual_seed(31)
    g = torch.randn(3, 2, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(5, 16, generator=gen, dtype=torch.float64)
    x = torch.randn(3, 2, 16, generator=gen, dtype=torch.float64)
    ops = torch.ops.cublas_guard
    with torch.no_grad(), torch._C._AutoDispatchBelowAutograd():
        want_x = ops.linear_grad_input.default(g, w, "l")
        want_w = ops.linear_grad_weight.default(g, x, "l")
    with torch.no_grad():
        assert torch.equal(direct.grad_input(g, w, "l"), want_x)
        assert torch.equal(direct.grad_weight(g, x, "l"), want_w)
        assert direct.guard_values(g, "l", 3, SYNC) is None
    torch.testing.assert_close(want_x, g @ w, rtol=1e-12, atol=1e-12)


def test_the_gradient_kernels_decline_what_the_dispatcher_must_see() -> None:
    direct = _direct_kernels()
    g, w = torch.randn(2, 5), torch.randn(5, 16)
    with torch.no_grad():
        for call in (
            lambda: direct.grad_input(g.as_subclass(_Sub), w, "l"),
            lambda: direct.grad_input(g, w, 3),
            lambda: direct.grad_input(g, w),
            lambda: direct.grad_weight(g.to_sparse(), w, "l"),
            lambda: direct.grad_input(g.to("meta"), w.to("meta"), "l"),
            lambda: direct.guard_values(g, "l", -1, SYNC),
            lambda: direct.guard_values(g, "l", 3, True),
        ):
            assert call() is NotImplemented
        with _CountingDispatch():
            assert direct.grad_input(g, w, "l") is NotImplemented
    assert direct.grad_input(g, w, "l") is NotImplemented  # gradients on: one may be recorded


def test_the_gradient_kernels_raise_the_typed_errors() -> None:
    direct = _direct_kernels()
    g = _poisoned()[:, :5].contiguous()
    with torch.no_grad():
        with pytest.raises(cg.NonFiniteInputError) as found:
            direct.guard_values(g, "grad.layer", 3, SYNC)
        assert found.value.fields["layer"] == "grad.layer"
        with pytest.raises(ValueError, match="grad.layer"):
            direct.grad_input(torch.randn(2, 4), torch.randn(5, 16), "grad.layer")


def test_a_backward_takes_the_gradient_kernels_from_c(monkeypatch: pytest.MonkeyPatch) -> None:
    direct = _direct_kernels()
    taken = []
    for name in ("grad_input", "grad_weight", "guard_values"):
        real = getattr(direct, name)

        def counting(*args, _real=real, _name=name):
            out = _real(*args)
            taken.append((_name, out is not NotImplemented))
            return out

        monkeypatch.setattr(direct, name, counting)
    layer = cg.SafeLinear(16, 5, mode="sync", name="c.backward", scan_grad=True)
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).square().sum().backward()
    assert sorted(taken) == [("grad_input", True), ("grad_weight", True), ("guard_values", True)]
    ref = torch.nn.Linear(16, 5)
    ref.load_state_dict(layer.state_dict())
    xr = x.detach().clone().requires_grad_()
    ref(xr).square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-6)


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 (compared by the caller)
        return "raised", exc


@pytest.mark.parametrize("entry", ENTRIES)
def test_tensors_whose_memory_is_not_their_values_go_through_the_dispatcher(entry) -> None:
    """A lazily negated view reads as its negation only through the dispatcher's Negative key; a
    ZeroTensor has no memory; nested and quantized tensors are refused by their keys. The C entry
    hands them back (None); whichever entry runs, the outcome is torch.ops'."""
    gen = torch.Generator().manual_seed(5)
    x, w, b = (torch.randn(*s, generator=gen) for s in ((3, 16), (5, 16), (5,)))
    op = torch.ops.cublas_guard.linear.default
    cases = [
        (x._neg_view(), w, b),
        (x, w._neg_view(), b),
        (x, w, b._neg_view()),
        (torch._efficientzerotensor(3, 16), w, b),
        (torch.nested.nested_tensor([x[:2], x]), w, b),
        (torch.quantize_per_tensor(x, 0.1, 0, torch.qint8), w, b),
    ]
    with torch.no_grad():
        for args in cases:
            got = _outcome(lambda a=args: entry(*a, "l", SYNC, False))
            if entry is not stable_core.fast_linear:
                assert got == ("ok", None), args[0]
            if got == ("ok", None):
                got = _outcome(lambda a=args: op(*a, "l", SYNC, False))
            want = _outcome(lambda a=args: op(*a, "l", SYNC, False))
            assert got[0] == want[0] and type(got[1]) is type(want[1]), (got, want)
        out = entry(x._neg_view(), w, b, "l", SYNC, False)
        out = op(x._neg_view(), w, b, "l", SYNC, False) if out is None else out
        torch.testing.assert_close(out, torch.nn.functional.linear(-x, w, b), rtol=1e-5, atol=1e-5)


def test_the_gradient_kernels_hand_back_a_lazily_negated_gradient() -> None:
    direct = _direct_kernels()
    g, w = torch.randn(2, 5), torch.randn(5, 16)
    with torch.no_grad():
        assert direct.grad_input(g._neg_view(), w, "l") is NotImplemented
        assert direct.grad_weight(g, torch.randn(2, 16)._neg_view(), "l") is NotImplemented
        assert direct.guard_values(g._neg_view(), "l", 3, SYNC) is NotImplemented
    layer = cg.SafeLinear(16, 5, name="neg.grad")
    x = torch.randn(2, 16, requires_grad=True)
    gx, gw = torch.autograd.grad(layer(x), (x, layer.weight), g._neg_view())
    torch.testing.assert_close(gx, -g @ layer.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, -g.t() @ x.detach(), rtol=1e-5, atol=1e-6)
