"""Guard modes: when and where each raises, with which layer and call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext.guarded_linear import modes

from helpers import assert_matches

NAN = float("nan")


def poisoned(shape=(4, 8), device="cpu") -> torch.Tensor:
    x = torch.randn(shape, device=device)
    x.view(-1)[5] = NAN
    return x


def test_sync_raises_in_the_offending_forward(device: str) -> None:
    layer = cg.SafeLinear(8, 3, mode="sync", name="l1").to(device)
    with pytest.raises(cg.NonFiniteInputError) as info:
        layer(poisoned(device=device))
    assert info.value.layer == "l1" and not info.value.fields.get("deferred")


def test_async_defers_to_the_next_guarded_call(device: str) -> None:
    first = cg.SafeLinear(8, 3, mode="async", name="first").to(device)
    other = cg.SafeLinear(3, 2, mode="off", name="other").to(device)
    for _ in range(2):
        first(torch.randn(4, 8, device=device))  # calls 1 and 2: clean
    out = first(poisoned(device=device))  # call 3: recorded, not raised
    assert out.isnan().any(), "the bad call's output is returned (and not to be trusted)"
    if device == "cuda":
        torch.cuda.synchronize()  # let the record reach the host before the next call reads it
    with pytest.raises(cg.NonFiniteInputError) as info:
        other(torch.randn(4, 3, device=device))  # any guarded call reports it, even mode off
    err = info.value
    assert err.layer == "first" and err.call == 3 and err.deferred is True
    assert err.first_bad_index == 5 and err.first_bad_coords == [0, 5] and err.shape == [4, 8]
    text = str(err)
    assert "layer 'first', call 3" in text and "not to be trusted" in text
    other(torch.randn(4, 3, device=device))  # reported once: the record is clear again


def test_async_check_and_first_bad_call_wins(device: str) -> None:
    layer = cg.SafeLinear(8, 3, mode="async", name="a").to(device)
    layer(poisoned(device=device))
    x2 = torch.randn(4, 8, device=device)
    x2[3, 7] = float("inf")
    # A second bad call. On the CPU the record is readable at once, so this call reports
    # the first finding as it starts; on a GPU it may run first, and must not overwrite it.
    try:
        cg.linear(x2, layer.weight, layer.bias, layer="b", mode="async")
    except cg.NonFiniteInputError as err:
        first = err
    else:
        # check() waits for the device and raises the first finding only.
        with pytest.raises(cg.NonFiniteInputError) as info:
            cg.check()
        first = info.value
    assert first.layer == "a" and first.call == 1
    assert first.nan_count == 1 and first.posinf_count == 0
    cg.check()  # nothing left: the second finding is not reported later either


def test_guard_block_reports_at_exit_at_the_latest(device: str) -> None:
    layer = cg.SafeLinear(8, 3, name="g").to(device)  # no own mode: follows the block
    with pytest.raises(cg.NonFiniteInputError, match="layer 'g', call"):
        with cg.guard("async"):
            layer(poisoned(device=device))
            assert modes.current() == "async"
    assert modes.current() == "sync"


def test_guard_block_does_not_mask_an_exception_in_flight() -> None:
    layer = cg.SafeLinear(8, 3, name="g")
    with pytest.raises(KeyError):
        with cg.guard("async"):
            layer(poisoned())
            raise KeyError("user error")
    with pytest.raises(cg.NonFiniteInputError):  # still recorded, reported on demand
        cg.check()


def test_off_mode_lets_values_through_but_keeps_host_checks(device: str) -> None:
    layer = cg.SafeLinear(8, 3, mode="off").to(device)
    out = layer(poisoned(device=device))
    assert out.isnan().any()
    with pytest.raises(cg.ShapeMismatchError):
        layer(torch.randn(2, 7, device=device))
    with pytest.raises(cg.DTypeError):
        layer(torch.randn(2, 8, device=device).double())


def test_layer_mode_overrides_block_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(modes.ENV_VAR, "off")
    assert modes.current() == "off"
    follower = cg.SafeLinear(8, 3)
    follower(poisoned())  # env says off: passes
    with cg.guard("sync", check_on_exit=False):
        with pytest.raises(cg.NonFiniteInputError):
            follower(poisoned())
        cg.SafeLinear(8, 3, mode="off")(poisoned())  # own mode wins over the block


def test_invalid_env_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(modes.ENV_VAR, "paranoid")
    with pytest.raises(ValueError, match="CUBLAS_GUARD_MODE='paranoid' is not a mode"):
        cg.SafeLinear(8, 3)(torch.randn(2, 8))


def test_guard_blocks_are_per_thread() -> None:
    import threading

    seen = {}
    inside = threading.Event()
    release = threading.Event()

    def worker() -> None:
        with cg.guard("off", check_on_exit=False):
            inside.set()
            release.wait(5)

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(5)
    seen["main"] = modes.current()
    release.set()
    t.join()
    assert seen["main"] == "sync"


def test_guard_blocks_are_per_asyncio_task() -> None:
    import asyncio

    seen: dict[str, str] = {}

    async def task(name: str, mode: str, first: asyncio.Event, second: asyncio.Event) -> None:
        with cg.guard(mode, check_on_exit=False):
            first.set()
            await second.wait()  # the other task enters its own block meanwhile
            seen[name] = modes.current()

    async def main() -> None:
        a_in, b_in = asyncio.Event(), asyncio.Event()
        await asyncio.gather(task("a", "async", a_in, b_in), task("b", "off", b_in, a_in))
        seen["outside"] = modes.current()

    asyncio.run(main())
    assert seen == {"a": "async", "b": "off", "outside": "sync"}


def test_guard_blocks_ending_out_of_order_remove_only_their_own_entry() -> None:
    def gen():
        with cg.guard("off", check_on_exit=False):
            yield modes.current()
            yield modes.current()

    g = gen()
    assert next(g) == "off"
    with cg.guard("async", check_on_exit=False):
        assert modes.current() == "async"
        g.close()  # the generator's block ends while the caller's is open
        assert modes.current() == "async"
    assert modes.current() == "sync"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_scan_grad_names_the_layer(device: str, mode: str) -> None:
    model = cg.replace_linear(
        nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2)), mode=mode, scan_grad=True
    ).to(device)
    out = model(torch.randn(4, 8, device=device))
    grad = torch.randn_like(out)
    grad[1, 1] = float("inf")  # an exploding loss gradient
    with pytest.raises(cg.NonFiniteInputError) as info:
        # sync: layer 2's backward raises; async: layer 0's backward scan (the next
        # guarded call) reports what layer 2's recorded, or check() does.
        out.backward(grad)
        cg.check()
    assert info.value.layer == "2" and info.value.role == "grad_output"
    assert info.value.first_bad_coords == [1, 1]
    if mode == "async":
        assert "layer '2', backward call 1" in str(info.value)


def test_scan_grad_off_by_default(device: str) -> None:
    layer = cg.SafeLinear(8, 2).to(device)
    out = layer(torch.randn(3, 8, device=device))
    out.backward(torch.full_like(out, NAN))  # not scanned: NaN gradients flow like nn.Linear's
    assert layer.weight.grad.isnan().all()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "off"])
def test_torch_compile_fullgraph_matches_eager(mode: str) -> None:
    torch.manual_seed(0)
    model = cg.replace_linear(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)), mode=mode)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(5, 8, requires_grad=True)
    eager_out = model(x)
    eager_out.square().sum().backward()
    eager_grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    out = compiled(x)
    out.square().sum().backward()
    assert_matches(out, eager_out)
    for got, want in zip([x.grad] + [p.grad for p in model.parameters()], eager_grads):
        assert_matches(got, want)
    if mode == "async":  # the record works from compiled code too
        bad = x.detach().clone()
        bad[2, 3] = NAN
        with pytest.raises(cg.NonFiniteInputError, match="layer '0', call"):
            compiled(bad)
            cg.check()


def test_torch_compile_refuses_bad_shapes_at_trace_time() -> None:
    model = torch.compile(cg.SafeLinear(8, 3, mode="off", name="traced"), fullgraph=True)
    with pytest.raises(Exception) as info:  # dynamo wraps errors raised while tracing
        model(torch.randn(2, 5))
    assert "traced" in str(info.value) and "in_features = 8" in str(info.value)


OPS = {
    "scan": lambda: (torch.ops.cublas_guard.scan.default, (torch.randn(7, 3),)),
    "linear_sync": lambda: (
        torch.ops.cublas_guard.linear.default,
        (
            torch.randn(4, 5, requires_grad=True),
            torch.randn(3, 5, requires_grad=True),
            torch.randn(3, requires_grad=True),
            "l",
            1,
            False,
        ),
    ),
    "linear_async_nobias": lambda: (
        torch.ops.cublas_guard.linear.default,
        (torch.randn(2, 4, 5, requires_grad=True), torch.randn(3, 5, requires_grad=True), None, "l", 2, True),
    ),
    "grad_input": lambda: (
        torch.ops.cublas_guard.linear_grad_input.default,
        (torch.randn(4, 3, requires_grad=True), torch.randn(3, 5, requires_grad=True), "l"),
    ),
    "grad_weight": lambda: (
        torch.ops.cublas_guard.linear_grad_weight.default,
        (torch.randn(4, 3, requires_grad=True), torch.randn(4, 5, requires_grad=True), "l"),
    ),
    "check_features": lambda: (torch.ops.cublas_guard.check_features.default, (torch.randn(4, 5), 5, "l")),
    "guard_values": lambda: (torch.ops.cublas_guard.guard_values.default, (torch.randn(4, 5), "l", 3, 1)),
    "check_in_graph": lambda: (torch.ops.cublas_guard.check_in_graph.default, (torch.randn(0),)),
}


@pytest.mark.parametrize("name", list(OPS))
def test_opcheck(name: str) -> None:
    op, args = OPS[name]()
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_functional_linear_matches_under_every_mode() -> None:
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    for mode in ("sync", "async", "off"):
        assert_matches(cg.linear(x, w, b, mode=mode), F.linear(x, w, b))


def test_async_call_numbers_are_per_layer_not_per_shape_or_reused_name() -> None:
    a, b = cg.SafeLinear(8, 8, mode="async"), cg.SafeLinear(8, 8, mode="async")
    for _ in range(3):
        a(torch.randn(2, 8))
    b(poisoned((2, 8)))
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert info.value.call == 1 and info.value.layer == b.guard_label != a.guard_label

    old = cg.replace_linear(nn.Sequential(nn.Linear(8, 4)), mode="async")
    for _ in range(5):
        old(torch.randn(2, 8))
    fresh = cg.replace_linear(nn.Sequential(nn.Linear(8, 4)), mode="async")  # same name, "0"
    fresh(poisoned((2, 8)))
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert info.value.layer == "0" and info.value.call == 1
    named = cg.SafeLinear(8, 4, mode="async", name="0")  # a name given by hand restarts it too
    named(poisoned((2, 8)))
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert info.value.call == 1
