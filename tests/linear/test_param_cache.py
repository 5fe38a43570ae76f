"""The clean-parameter cache: every writer of a parameter is seen, swap_tensors works,
and its cost and size do not depend on the number of live parameters."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg

from helpers import assert_matches

NAN = float("nan")
_ops = torch.ops.cublas_guard

# The version-counter parameter cache is the locked library's (the stable core scans every call).
pytestmark = pytest.mark.locked


def cache_stats() -> tuple[int, int, int]:
    """(entries, entries whose tensor is alive, generation)."""
    entries, live, generation = torch.ops.cublas_guard_testing.clean_cache_stats.default()
    return entries, live, generation


# ---------------------------------------------------------------------------
# Every optimizer of torch.optim, plain, foreach and fused, writing NaN
# ---------------------------------------------------------------------------
OPTIMIZERS = {
    "ASGD": {},
    "Adadelta": {},
    "Adafactor": {},
    "Adagrad": {},
    "Adam": {},
    "AdamW": {},
    "Adamax": {},
    "LBFGS": {},
    "Muon": {},
    "NAdam": {},
    "RAdam": {},
    "RMSprop": {},
    "Rprop": {},
    "SGD": {"lr": 0.1},
    "SparseAdam": {},
}


def test_the_list_covers_every_optimizer_of_torch_optim() -> None:
    found = {
        name
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type)
        and issubclass(cls, torch.optim.Optimizer)
        and cls is not torch.optim.Optimizer
    }
    assert found == set(OPTIMIZERS), f"new or removed optimizers: {found ^ set(OPTIMIZERS)}"


def _variants() -> list[tuple[str, str]]:
    out = []
    for name in OPTIMIZERS:
        params = inspect.signature(getattr(torch.optim, name).__init__).parameters
        out.append((name, "plain"))
        if "foreach" in params:
            out.append((name, "foreach"))
        if "fused" in params:
            out.append((name, "fused"))
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name,variant", _variants())
def test_an_optimizer_step_writing_nan_is_seen_by_the_next_forward(
    name: str, variant: str, mode: str
) -> None:
    layer = cg.SafeLinear(8, 4, mode=mode, name="opt")
    x = torch.randn(3, 8)
    layer(x)  # the weight is now known clean
    cg.check()
    kwargs = dict(OPTIMIZERS[name])
    if variant == "foreach":
        kwargs["foreach"] = True
    elif variant == "fused":
        kwargs["fused"] = True
    # Muon takes 2-D parameters only; the weight is the parameter under test anyway.
    params = [layer.weight] if name == "Muon" else list(layer.parameters())
    try:
        opt = getattr(torch.optim, name)(params, **kwargs)
    except RuntimeError as err:  # fused kernels this CPU build does not have
        pytest.skip(f"{name}({variant}) not available here: {err}")

    grad = torch.randn(4, 8)
    grad[1, 2] = NAN
    if name == "SparseAdam":
        layer.weight.grad = grad.to_sparse()
        layer.bias.grad = torch.randn(4).to_sparse()
    elif name == "Rprop":  # Rprop uses only the gradient's sign (0 for NaN): poison the step size
        layer.weight.grad, layer.bias.grad = torch.randn(4, 8), torch.randn(4)
        opt.param_groups[0]["lr"] = NAN
    else:
        layer.weight.grad, layer.bias.grad = grad, torch.randn(4)
    try:
        if name == "LBFGS":
            opt.step(lambda: torch.tensor(1.0))
        else:
            opt.step()
    except RuntimeError as err:
        if variant == "fused" and "fused" in str(err).lower():
            pytest.skip(f"{name}(fused) not available on this device: {err}")
        raise
    assert not torch.isfinite(layer.weight).all(), "the step did not write a non-finite weight"
    with pytest.raises(cg.NonFiniteInputError) as info:
        layer(x)
        cg.check()  # async: the next guarded call or check() reports it
    assert info.value.layer == "opt" and info.value.fields["role"] == "weight"


def test_an_in_place_write_under_no_grad_is_seen_without_any_optimizer() -> None:
    layer = cg.SafeLinear(8, 4, name="w")
    x = torch.randn(3, 8)
    layer(x)
    generation = cache_stats()[2]
    with torch.no_grad():
        layer.weight[0, 0] = NAN  # bumps the version counter only
    assert cache_stats()[2] == generation
    with pytest.raises(cg.NonFiniteInputError, match="weight"):
        layer(x)


def test_an_unchanged_parameter_is_not_scanned_again() -> None:
    """The cache must really skip: a NaN written where no detector sees it (through
    `.data`, documented in docs/guarantees.md) passes until the next tracked change."""
    layer = cg.SafeLinear(8, 4, name="w")
    x = torch.randn(3, 8)
    layer(x)
    layer.weight.data[0, 0] = NAN
    layer(x)  # not re-scanned: the documented blind spot
    torch.optim.SGD(layer.parameters(), lr=0.0).step()  # no grads: writes nothing, but counts
    with pytest.raises(cg.NonFiniteInputError, match="weight"):
        layer(x)


def test_a_nan_weight_reported_in_async_mode_is_reported_again_in_sync_mode() -> None:
    """After an async report the cache is cleared: the async call marked the weight
    clean before its scan's result was known."""
    layer = cg.SafeLinear(8, 4, mode="async", name="a")
    x = torch.randn(3, 8)
    layer(x)
    with torch.no_grad():
        layer.weight[2, 3] = NAN
    layer(x)  # recorded
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert info.value.fields["role"] == "weight"
    layer.mode = "sync"
    with pytest.raises(cg.NonFiniteInputError) as info:
        layer(x)
    assert info.value.fields["role"] == "weight" and "deferred" not in info.value.fields


def test_a_freed_parameter_whose_address_is_reused_is_not_taken_for_clean() -> None:
    x = torch.randn(3, 8)
    clean = torch.randn(4, 8)
    bad = clean.clone()
    bad[1, 1] = NAN
    for _ in range(50):
        w = clean.clone()
        cg.linear(x, w, layer="reuse")  # marked clean
        del w
        w = bad.clone()  # often the same TensorImpl and data addresses, version 0
        with pytest.raises(cg.NonFiniteInputError, match="weight"):
            cg.linear(x, w, layer="reuse")


# ---------------------------------------------------------------------------
# torch.utils.swap_tensors and the conversions that use it
# ---------------------------------------------------------------------------
@pytest.fixture
def swap_on_conversion():
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(old)


@pytest.mark.parametrize("mode", ["sync", "async", "off"])
def test_swap_tensors_after_forward(mode: str) -> None:
    layer = cg.SafeLinear(8, 4, mode=mode, name="s")
    x = torch.randn(3, 8)
    layer(x).sum().backward()
    new = nn.Parameter(torch.randn(4, 8))
    expected = new.detach().clone()
    torch.utils.swap_tensors(layer.weight, new)
    assert torch.equal(layer.weight, expected)
    assert_matches(layer(x), F.linear(x, expected, layer.bias))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_conversions_and_load_state_dict_with_swap_on_conversion(mode: str, swap_on_conversion) -> None:
    torch.manual_seed(1)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = cg.replace_linear(copy.deepcopy(ref), mode=mode)
    x = torch.randn(5, 8)
    model(x).sum().backward()
    weight_object = model[0].weight
    model.double()  # swaps every parameter's TensorImpl
    assert model[0].weight is weight_object and model[0].weight.dtype == torch.float64
    model.half().float().to("cpu")
    assert model[0].weight.dtype == torch.float32
    # fp16 round trip: compare with the same conversion of nn.Linear
    ref.half().float()
    assert_matches(model(x), ref(x))
    cg.check()
    state = ref.state_dict()
    state["2.weight"] = state["2.weight"].clone()
    state["2.weight"][0, 0] = NAN
    model.load_state_dict(state)
    with pytest.raises(cg.NonFiniteInputError) as info:
        model(x)
        cg.check()
    assert info.value.layer == "2" and info.value.fields["role"] == "weight"


# ---------------------------------------------------------------------------
# Size and eviction (the default-suite twin of the slow leak test)
# ---------------------------------------------------------------------------
def test_dead_entries_are_evicted_as_new_ones_come() -> None:
    x = torch.randn(2, 8)
    cg.linear(x, torch.randn(4, 8), layer="warm")
    for i in range(3000):  # a fresh weight per call, dead right after
        cg.linear(x, torch.randn(4, 8), layer="fresh")
        if i % 500 == 499:
            entries, live, _ = cache_stats()
            assert entries <= 2 * live + 64, f"{entries} entries, {live} alive, after {i + 1} calls"


def test_live_parameters_stay_cached_and_the_size_stays_proportional() -> None:
    x = torch.randn(2, 8)
    layers = [cg.SafeLinear(8, 4, name=f"l{i}") for i in range(300)]
    for _ in range(3):
        for layer in layers:
            layer(x)
    entries, live, _ = cache_stats()
    assert live >= 600  # 300 weights + 300 biases, all still known
    assert entries <= 2 * live + 100
    del layers
    for _ in range(1000):  # new entries sweep the dead ones out
        cg.linear(x, torch.randn(4, 8), layer="fresh")
    entries, live_after, _ = cache_stats()
    assert live_after <= live - 600 + 64 and entries <= 2 * live_after + 64, (entries, live_after)


def test_an_optimizer_step_bumps_the_generation_once() -> None:
    layer = cg.SafeLinear(4, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    before = cache_stats()[2]
    layer(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert cache_stats()[2] == before + 1
