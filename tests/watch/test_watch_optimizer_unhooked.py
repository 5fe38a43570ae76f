"""watch: torch's own optimizers step unhooked, and what the step wrote is judged when it returns
(issue 50: the hook's per-op cost on AdamW's eight parameter-sized outputs per parameter was half
of a watched MiniLM step's extra time). A closure, a subclass or another library's optimizer
stays watched op by op; a value non-finite before the step is never called born in it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from test_watch_optimizer import ADAM_VARIANTS, Tiny, _step

import cublas_guard_ext as cg
from cublas_guard_ext.errors.optimizer_step import STEP_WRITES_OP

from helpers.watch_models import nothing_left


def _tiny_adamw(**kwargs) -> tuple[Tiny, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tiny()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)


LARGE = (256, 256)  # read by the fused scan (a small tensor is counted inline)


def _params(n: int = 3, shape: tuple[int, ...] = (8, 4)) -> list[nn.Parameter]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(*shape)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _scans_of_one_watched_step(opt: torch.optim.Optimizer) -> int:
    """The scans one step of ``opt`` makes in a block of its own."""
    with cg.watch(mode="sync") as w:
        _, scans = w.stats()
        opt.step()
        return w.stats()[1] - scans


@pytest.mark.parametrize("kwargs", ADAM_VARIANTS)
def test_a_torch_optimizer_steps_unhooked_with_one_scan_per_tensor_it_wrote(kwargs):
    params = _params(shape=LARGE)
    opt = torch.optim.AdamW(params, lr=1e-3, **kwargs)
    opt.step()  # the states exist
    with cg.watch(mode="sync") as w:
        ops, scans = w.stats()
        opt.step()
        ops_after, scans_after = w.stats()
    # the profiler's record_function enter/exit around step() are the only ops the hook sees
    assert ops_after - ops <= 2
    # each parameter; its exp_avg is proven finite by the finite parameter, and its exp_avg_sq
    # bounded by its gradient's and its own bounds, which their first sights found (not fused:
    # a GradScaler's scale may divide its gradient, so exp_avg_sq is read)
    assert scans_after - scans == (2 if kwargs.get("fused") else 1) * len(params)
    nothing_left()


FIRST_MOMENT_CLASSES = ["Adam", "AdamW", "NAdam", "RAdam", "Adamax"]


@pytest.mark.parametrize("name", FIRST_MOMENT_CLASSES)
@pytest.mark.parametrize("kwargs", [{"foreach": False}, {"foreach": True}], ids=["single-tensor", "foreach"])
def test_a_non_finite_first_moment_is_still_named_where_a_finite_parameter_would_prove_it(name, kwargs):
    # exp_avg.lerp_(grad, 0.1) computes exp_avg + 0.1 * (grad - exp_avg): 3e38 and -3e38 give
    # -inf there from finite values; the parameter then turns non-finite, so exp_avg is read and
    # named (not the parameter, nor exp_avg_sq/exp_inf, which come after it)
    params = _params(1, shape=LARGE)
    opt = getattr(torch.optim, name)(params, lr=1e-3, **kwargs)
    opt.step()  # the states exist
    with torch.no_grad():
        opt.state[params[0]]["exp_avg"].fill_(3e38)
    params[0].grad.fill_(-3e38)
    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(mode="sync"):
        opt.step()
    assert info.value.op == STEP_WRITES_OP and info.value.state == "exp_avg", str(info.value)
    assert not torch.isfinite(params[0]).all()
    nothing_left()


@pytest.mark.parametrize("shape", [LARGE, (8, 4)], ids=["large", "small"])
@pytest.mark.parametrize("name", FIRST_MOMENT_CLASSES + ["SGD"])
def test_only_the_adam_familys_first_moment_goes_unread(name, shape):
    params = _params(shape=shape)
    opt = getattr(torch.optim, name)(params, lr=1e-3, **({"momentum": 0.9} if name == "SGD" else {}))
    opt.step()
    scans = _scans_of_one_watched_step(opt)
    states = sum(t.dim() > 0 for t in opt.state[params[0]].values())
    proven = {"SGD": 0, "Adamax": 1}.get(name, 2)  # exp_avg, and exp_avg_sq (Adamax has exp_inf)
    assert scans == (1 + states - proven) * len(params)
    nothing_left()


# exp_avg_sq = b2 * exp_avg_sq + (1 - b2) * grad * grad: 1e-3 * 1e21 * 1e21 = 1e39 overflows
# float32 to +Inf, while the parameter's update exp_avg / (sqrt(Inf) + eps) is 0 and stays finite,
# so only a read of exp_avg_sq sees it. The gradient's scan finds 1e21 above the small bound
# (2^62 = 4.6e18): no proof, the state is read and named.
SECOND_MOMENT_CLASSES = ["Adam", "AdamW", "NAdam", "RAdam"]


@pytest.mark.parametrize("name", SECOND_MOMENT_CLASSES)
@pytest.mark.parametrize("kwargs", [{"foreach": False}, {"foreach": True}], ids=["single-tensor", "foreach"])
@pytest.mark.parametrize("shape", [LARGE, (8, 4)], ids=["large", "small"])
def test_a_second_moment_overflowed_by_a_large_gradient_is_still_named(name, kwargs, shape):
    params = _params(1, shape=shape)
    opt = getattr(torch.optim, name)(params, lr=1e-3, **kwargs)
    opt.step()  # the states exist
    params[0].grad.fill_(1e-3)
    params[0].grad[0, 1] = 1e21
    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(mode="sync"):
        opt.step()
    assert info.value.op == STEP_WRITES_OP and info.value.state == "exp_avg_sq", str(info.value)
    assert torch.isfinite(params[0]).all()  # the parameter alone would not tell
    nothing_left()


@pytest.mark.parametrize(
    "grad",
    [pytest.param(2.0**62, id="at-the-bound"), pytest.param(2.0**62 * (1 - 2**-23), id="below")],
)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_the_gradients_bound_is_where_its_square_stays_finite(grad, layout):
    # 2^62 is large (read), the float32 below it small (proven): the bound is exact, counted inline
    # or by the fused scan's contiguous and strided loops
    for shape in [LARGE, (8, 4)]:
        params = _params(1, shape=shape)
        opt = torch.optim.AdamW(params, lr=1e-3)
        opt.step()
        if layout == "transposed":
            params[0].grad = torch.randn(shape[::-1]).t()
        params[0].grad[0, 0] = grad
        assert _scans_of_one_watched_step(opt) == (2 if grad == 2.0**62 else 1), shape
    nothing_left()


@pytest.mark.parametrize(
    "group",
    [
        {"amsgrad": True},
        {"fused": True},
        {"betas": (0.9, 1.0 - 1e-7)},
        {"weight_decay": 0.1, "name": "Adam"},
        {"weight_decay": 0.1, "name": "RAdam"},
        {"weight_decay": 0.1, "decoupled_weight_decay": True, "name": "Adam", "proven": True},
        {"weight_decay": 0.1, "name": "AdamW", "proven": True},
        {"dtype": torch.float64, "proven": True},
        {"dtype": torch.bfloat16},
    ],
    ids=lambda g: ",".join(f"{k}={v}" for k, v in g.items() if k != "proven"),
)
def test_the_second_moment_is_read_where_its_update_is_not_the_plain_one(group):
    group = dict(group)
    name, proven, dtype = group.pop("name", "AdamW"), group.pop("proven", False), group.pop("dtype", None)
    params = _params(1, shape=LARGE)
    if dtype is not None:
        params = [nn.Parameter(p.detach().to(dtype)) for p in params]
        params[0].grad = torch.randn_like(params[0])
    opt = getattr(torch.optim, name)(params, lr=1e-3, **group)
    opt.step()
    scans = _scans_of_one_watched_step(opt)
    states = sum(t.dim() > 0 for t in opt.state[params[0]].values())
    assert scans == states - (2 if proven else 1) + 1
    nothing_left()


def test_the_first_step_judges_the_states_it_made():
    params = _params(1)
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    params[0].grad.fill_(3e38)
    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(mode="sync"):
        opt.step()  # the buffer is a copy of the gradient: finite
        opt.step()  # 0.9 * 3e38 + 3e38 overflows
    assert info.value.op == STEP_WRITES_OP and info.value.state == "momentum_buffer"


def _overflowing_sgd(model: nn.Module, opt: torch.optim.Optimizer, closure: bool) -> cg.NonFiniteOutputError:
    _step(model, opt, 3e38)  # the momentum buffer starts as a copy of the gradient: finite

    def loss_and_grads() -> torch.Tensor:
        loss = model(torch.ones(3, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        with torch.no_grad():
            model.emb.weight.grad.fill_(3e38)
        return loss

    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(model, mode="sync"):
        if closure:
            opt.step(loss_and_grads)  # the model runs inside step(): its ops stay hooked
        else:
            loss_and_grads()
            opt.step()
    return info.value


def test_a_step_with_a_closure_stays_watched_op_by_op():
    model = Tiny()
    err = _overflowing_sgd(
        model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=False), True
    )
    assert err.op.startswith("aten.") and err.op != STEP_WRITES_OP
    assert err.phase == "optimizer step" and err.state == "momentum_buffer" and err.parameter == "emb.weight"
    nothing_left()


class MySGD(torch.optim.SGD):
    """Another library's optimizer (here: a subclass) may write anything: watched op by op."""


def test_a_subclass_of_a_torch_optimizer_stays_watched_op_by_op():
    model = Tiny()
    err = _overflowing_sgd(model, MySGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=False), False)
    assert err.op.startswith("aten.") and err.optimizer == "MySGD" and err.state == "momentum_buffer"
    plain = Tiny()
    err = _overflowing_sgd(
        plain, torch.optim.SGD(plain.parameters(), lr=1e-3, momentum=0.9, foreach=False), False
    )
    assert err.op == STEP_WRITES_OP and err.state == "momentum_buffer"


@pytest.mark.parametrize("report", ["consequence", "birth"])
def test_a_nan_in_a_state_from_before_the_block_is_not_born_in_the_parameter_it_reaches(report):
    model, opt = _tiny_adamw()
    _step(model, opt, 1.0)
    with torch.no_grad():
        opt.state[model.emb.weight]["exp_avg"][0, 0] = float("nan")  # e.g. a bad checkpoint
    with cg.watch(model, mode="sync", report=report):
        _step(model, opt, 1.0)  # the parameter turns NaN: not this step's birth
    assert torch.isnan(model.emb.weight).any()
    nothing_left()


def test_a_step_that_raised_leaves_the_next_forward_watched():
    model, opt = _tiny_adamw()
    _step(model, opt, 1.0)
    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(model, mode="sync"):
        lr = opt.param_groups[0]["lr"]
        opt.param_groups[0]["lr"] = "0.1"  # a string: step() raises inside, its post hook never runs
        with pytest.raises(TypeError):
            opt.step()
        opt.param_groups[0]["lr"] = lr
        with torch.no_grad():
            model.head.weight.fill_(1e30)
        model(torch.full((3, 4), 1e30))  # overflows in the model's forward: named there
    assert info.value.phase == "forward" and info.value.module == "head"
    nothing_left()


def _block_per_step(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        with cg.watch(model, mode="sync"):  # as run --watch: a block per step
            _step(model, opt, 1.0)


def test_what_a_step_found_finite_is_not_read_again_by_the_next_block(monkeypatch):
    model, opt = _tiny_adamw()
    _block_per_step(model, opt, 1)
    native = cg.watching.optimizer_step._native
    begun, checked = [], []
    real_all_finite, real_begin = native._watch_all_finite, native._watch_optimizer_begin
    monkeypatch.setattr(native, "_watch_all_finite", lambda ts: checked.extend(ts) or real_all_finite(ts))
    monkeypatch.setattr(
        native,
        "_watch_optimizer_begin",
        lambda scan, finite, bounded: (
            begun.append((scan, finite, bounded)) or real_begin(scan, finite, bounded)
        ),
    )
    _block_per_step(model, opt, 1)
    scan, finite, bounded = begun[-1]
    states = [t for p in model.parameters() for t in opt.state[p].values() if t.dim() > 0]
    assert {id(t) for t in finite} == {id(t) for t in [*model.parameters(), *states]}
    # ...and each exp_avg_sq keeps the bound the last step's end found (its read is spared again)
    assert {id(t) for t in bounded} == {id(opt.state[p]["exp_avg_sq"]) for p in model.parameters()}
    assert all(t is p.grad for t, p in zip(scan, model.parameters()))  # only the new gradients
    assert checked == []  # the entry check read no parameter either
    nothing_left()


def test_a_second_moments_bound_is_carried_to_the_next_block_and_lost_with_a_write():
    model, opt = _tiny_adamw()
    _block_per_step(model, opt, 2)

    def step_scans() -> int:
        with cg.watch(model, mode="sync") as w:
            _step(model, opt, 1.0)
            return w.stats()[1]

    base = step_scans()  # every exp_avg_sq proven: its bound came from the last block's end
    v = opt.state[model.emb.weight]["exp_avg_sq"]
    # (stats() counts the scans of outputs: a first sight at the step's start is not one)
    with torch.no_grad():
        v[0, 0] = 1.0  # moves its version: its first sight reads it, finds it small: proven again
    assert step_scans() == base
    with torch.no_grad():
        v[0, 0] = 3e30  # finite, above 2^62: no bound from a read, so it is read at each step's
    assert step_scans() == base + 1  # end until it decays below 2^62
    assert step_scans() == base + 1
    nothing_left()


def test_a_state_written_after_the_step_is_read_again():
    model, opt = _tiny_adamw()
    _block_per_step(model, opt, 2)
    with torch.no_grad():
        opt.state[model.emb.weight]["exp_avg"][0, 0] = float("nan")  # moves its version
    _block_per_step(model, opt, 1)  # first sight finds it: the parameter's NaN is not born here
    assert torch.isnan(model.emb.weight).any()


def test_a_parameter_written_by_an_unwatched_fused_step_is_checked_on_entry():
    model, opt = _tiny_adamw(fused=True)
    _block_per_step(model, opt, 1)
    model(torch.ones(3, 4)).sum().backward()
    model.emb.weight.grad[0, 0] = float("nan")
    version = model.emb.weight._version
    opt.step()  # unwatched; the fused kernel moves no version
    assert model.emb.weight._version == version and torch.isnan(model.emb.weight).any()
    with pytest.raises(cg.NonFiniteEntryError) as info, cg.watch(model, mode="sync"):
        pass
    assert info.value.name == "emb.weight"


class Wrapped(torch.Tensor):
    """A tensor subclass (FSDP2's DTensor is one): the step's ops on it stay watched one by one."""


def test_a_step_over_tensor_subclass_parameters_stays_watched_op_by_op():
    torch.manual_seed(0)
    model = Tiny()
    for module in (model.emb, model.head):
        module.weight = nn.Parameter(module.weight.detach().as_subclass(Wrapped))
    opt = torch.optim.SGD(model.parameters(), lr=1e30)
    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(model, mode="sync"):
        _step(model, opt, 1e10)  # weight - 1e30 * 1e10 overflows
    assert info.value.op.startswith("aten.") and info.value.state == "the parameter"
