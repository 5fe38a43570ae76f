"""TrainingGuard: a bad step is never applied, is replayed under watch and named,
classified transient or persistent; "skip" equals a run without that batch, bitwise."""

from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg

from helpers import requires_cuda


class InfGrad(torch.autograd.Function):
    """Identity forward; backward divides by zero (Inf from finite inputs, in backward only)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / torch.zeros_like(grad)


class Fault(nn.Module):
    """Planted faults, switched by ``mode``:
    "log": a forward producer (log of a negative number);
    "backward": finite forward, NaN in backward (sqrt at 0: an Inf gradient, times 0);
    "function": finite forward, Inf in a custom autograd.Function's backward;
    "once": a one-shot forward NaN (the next call is clean: transient);
    "random": NaN when this step's random draw exceeds 0.9 (reproduces only with the RNG restored)."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = ""
        self.draws: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "log":
            return x + torch.log(-x.abs() - 1.0)
        if self.mode == "backward":
            return x + torch.sqrt(torch.relu(x) * 0.0)
        if self.mode == "function":
            return InfGrad.apply(x)
        if self.mode == "once":
            self.mode = ""
            return x + torch.log(-x.abs() - 1.0)
        if self.mode == "random":
            u = torch.rand(())
            self.draws.append(float(u))
            return x + torch.log(0.9 - u)  # NaN iff u > 0.9
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.25)
        self.act = Fault()
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.drop(F.relu(self.bn(self.fc1(x))))))


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)) for _ in range(n)]


def setup(seed: int = 0, opt: str = "adamw", **kw):
    torch.manual_seed(seed)
    model = Net()
    if opt == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **kw)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return model, optimizer


def closure_for(model, optimizer, batch):
    def closure():
        optimizer.zero_grad()
        x, y = batch
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


def state(model, optimizer) -> dict[str, torch.Tensor]:
    """Everything a step could change: parameters, buffers, optimizer state, the RNG."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(optimizer.state.values()):
        for k, v in s.items():
            out[f"opt.{i}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    out["rng.cpu"] = torch.get_rng_state()
    return out


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def run(model, optimizer, data, guard=None, fault_at=None, mode="log"):
    """Train on data; plant ``mode`` for the 1-based step ``fault_at``. Returns the losses."""
    losses = []
    for i, batch in enumerate(data, start=1):
        if i == fault_at:
            model.act.mode = mode
        closure = closure_for(model, optimizer, batch)
        try:
            if guard is None:
                losses.append(closure())
                optimizer.step()
            else:
                losses.append(guard.step(closure))
        finally:
            if i == fault_at and mode != "random":
                model.act.mode = ""
    return losses


# -- healthy steps ------------------------------------------------------------------------


def test_healthy_steps_equal_an_unguarded_loop_bitwise():
    data = batches(5)
    m1, o1 = setup()
    m2, o2 = copy.deepcopy(m1), None
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    torch.manual_seed(7)
    plain = run(m1, o1, data)
    s1 = state(m1, o1)
    torch.manual_seed(7)
    guard = cg.TrainingGuard(m2, o2)
    guarded = run(m2, o2, data, guard)
    assert all(torch.equal(a, b) for a, b in zip(plain, guarded))
    assert_bitwise(s1, state(m2, o2))
    assert guard.steps == 5 and guard.skipped == [] and guard.stepped


# -- planted faults: each named, nothing lost ---------------------------------------------


def bad_step(mode: str, fault_at: int = 3, steps: int = 5, seed: int = 0, **guard_kw):
    """Run until the guard raises at the planted step; the state before that step and after."""
    model, optimizer = setup(seed)
    guard = cg.TrainingGuard(model, optimizer, **guard_kw)
    data = batches(steps)
    run(model, optimizer, data[: fault_at - 1], guard)
    before = state(model, optimizer)
    bn_before = model.bn.running_mean.clone()
    model.act.mode = mode
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure_for(model, optimizer, data[fault_at - 1]))
    model.act.mode = ""
    return info.value, before, state(model, optimizer), model, optimizer, guard, bn_before


@pytest.mark.locked
def test_forward_producer_at_step_k_is_named_and_nothing_is_lost():
    err, before, after, model, optimizer, guard, _ = bad_step("log")
    assert isinstance(err, ValueError) and isinstance(err, cg.GuardError)
    assert err.step == 3 and err.op == "aten.log.default" and err.module == "act" and err.phase == "forward"
    assert err.classification == "persistent" and err.rank is None
    assert "deferred" not in err.fields and "deferred:" not in str(err)  # raised in the step itself
    assert math.isnan(err.loss)
    assert err.bad_gradient_count == 6 and err.bad_gradients[:3] == ["fc1.weight", "fc1.bias", "bn.weight"]
    assert isinstance(err.__cause__, cg.NonFiniteOutputError)
    text = str(err)
    assert text.startswith("training step 3: loss nan, non-finite gradients in 6 parameters")
    assert "aten.log.default in module 'act' (forward)" in text and "persistent" in text
    assert_bitwise(before, after)  # parameters, BN buffers, AdamW state, RNG
    assert all(p.grad is None for p in model.parameters())


def test_bad_step_restores_batchnorm_statistics_that_its_forward_changed():
    # Without the restore the forward of the bad step (and its replay) moves running_mean.
    model, optimizer = setup()
    x, _ = batches(1)[0]
    before = model.bn.running_mean.clone()
    model(x)
    assert not torch.equal(before, model.bn.running_mean), "the forward must change the buffer"
    err, before, after, model, *_, bn_before = bad_step("log")
    assert torch.equal(model.bn.running_mean, bn_before)
    assert model.bn.num_batches_tracked.item() == 2


@pytest.mark.locked
def test_inf_in_a_custom_function_backward_is_named_by_op_and_phase():
    # a custom Function's node carries no module (its forward runs without autograd): the
    # op and the phase are named, the module is not
    err, before, after, *_ = bad_step("function")
    assert err.op == "aten.div.Tensor" and err.module is None and err.phase == "backward"
    assert err.classification == "persistent"
    assert_bitwise(before, after)


@pytest.mark.locked
def test_backward_only_inf_is_named_in_backward():
    err, before, after, *_ = bad_step("backward")
    assert err.module == "act" and err.phase == "backward"
    assert err.__cause__.backward_node == "SqrtBackward0"
    assert err.classification == "persistent" and math.isfinite(err.loss)
    assert "(backward)" in str(err)
    assert_bitwise(before, after)


def test_one_shot_nan_is_transient():
    err, before, after, *_ = bad_step("once")
    assert err.classification == "transient"
    assert err.op is None and err.module is None and err.phase is None
    assert math.isnan(err.loss)
    assert "transient: the replay (same batch, same RNG states) is finite" in str(err)
    assert_bitwise(before, after)


@pytest.mark.locked
def test_nan_from_a_random_draw_is_persistent_because_the_rng_is_restored():
    model, optimizer = setup(seed=1)
    guard = cg.TrainingGuard(model, optimizer)
    model.act.mode = "random"
    data = batches(40)
    states = []
    with pytest.raises(cg.NonFiniteStepError) as info:
        for b in data:
            states.append(torch.get_rng_state())
            guard.step(closure_for(model, optimizer, b))
    err, draws = info.value, model.act.draws
    # the bad draw, then the replay's draw: the same number, from the restored generator
    assert draws[-2] > 0.9 and draws[-1] == draws[-2]
    assert all(d <= 0.9 for d in draws[:-2]) and err.step == len(draws) - 1 == len(states)
    assert err.classification == "persistent" and err.op == "aten.log.default" and err.module == "act"
    # and afterwards the generator is back where it was before the bad step
    assert torch.equal(torch.get_rng_state(), states[-1])


def test_rng_states_python_numpy_and_torch_are_restored():
    model, optimizer = setup()
    guard = cg.TrainingGuard(model, optimizer)
    batch = batches(1)[0]
    inner = closure_for(model, optimizer, batch)

    def closure():
        random.random(), np.random.rand(), torch.rand(3)
        model.act.mode = "log"
        try:
            return inner()
        finally:
            model.act.mode = ""

    r, n, t = random.getstate(), np.random.get_state(), torch.get_rng_state()
    with pytest.raises(cg.NonFiniteStepError):
        guard.step(closure)
    assert random.getstate() == r and torch.equal(torch.get_rng_state(), t)
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), n))


@pytest.mark.locked
def test_non_finite_parameter_is_named_at_entry():
    model, optimizer = setup()
    guard = cg.TrainingGuard(model, optimizer)
    with torch.no_grad():
        model.fc2.weight[0, 3] = float("inf")
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure_for(model, optimizer, batches(1)[0]))
    err = info.value
    assert err.phase == "entry" and err.module == "fc2.weight" and err.classification == "persistent"
    assert isinstance(err.__cause__, cg.NonFiniteEntryError)
    assert "parameter 'fc2.weight'" in str(err)


# -- skip ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["log", "backward", "once"])
def test_skip_equals_a_run_without_that_batch_bitwise(mode):
    data = batches(6)
    m1, o1 = setup()
    m2 = copy.deepcopy(m1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    torch.manual_seed(11)
    guard = cg.TrainingGuard(m1, o1, on_nan="skip")
    with pytest.warns(RuntimeWarning, match="training step 3: "):
        losses = run(m1, o1, data, guard, fault_at=3, mode=mode)
    assert losses[2] is None and all(isinstance(x, torch.Tensor) for i, x in enumerate(losses) if i != 2)
    assert [e.step for e in guard.skipped] == [3] and isinstance(guard.skipped[0], cg.NonFiniteStepError)
    torch.manual_seed(11)
    ref = run(m2, o2, data[:2] + data[3:])
    assert all(torch.equal(a, b) for a, b in zip(losses[:2] + losses[3:], ref))
    assert_bitwise(state(m1, o1), state(m2, o2))


def test_skip_then_raise_leaves_grads_none_and_steps_counted():
    model, optimizer = setup()
    guard = cg.TrainingGuard(model, optimizer, on_nan="skip")
    model.act.mode = "log"
    with pytest.warns(RuntimeWarning):
        assert guard.step(closure_for(model, optimizer, batches(1)[0])) is None
    assert not guard.stepped and all(p.grad is None for p in model.parameters())
    assert optimizer.state == {}  # AdamW never stepped: no state created


# -- host syncs ------------------------------------------------------------------------------


def count_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _o=original, _n=name, **k):
            reads.append(_n)
            return _o(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def test_one_host_read_per_healthy_step(monkeypatch):
    model, optimizer = setup(opt="sgd")  # (the single-tensor AdamW reads its step count itself)
    guard = cg.TrainingGuard(model, optimizer)
    data = batches(3)
    reads = count_reads(monkeypatch)
    for b in data:
        guard.step(closure_for(model, optimizer, b))
    assert reads == ["item"] * 3


def test_deferred_healthy_steps_read_nothing_on_the_host_during_the_step(monkeypatch):
    model, optimizer = setup(fused=True)
    guard = cg.TrainingGuard(model, optimizer, deferred=True)
    data = batches(3)
    guard.step(closure_for(model, optimizer, data[0]))
    reads = count_reads(monkeypatch)
    guard.step(closure_for(model, optimizer, data[1]))  # reads step 1's flag (ready long ago), no other
    assert reads == ["item"]


@pytest.mark.locked
def test_deferred_bad_step_is_reported_at_the_next_step_with_nothing_lost():
    model, optimizer = setup(fused=True)
    guard = cg.TrainingGuard(model, optimizer, deferred=True)
    data = batches(5)

    def bound(batch):  # a deferred replay runs later: the closure binds its batch
        return closure_for(model, optimizer, batch)

    guard.step(bound(data[0]))
    guard.step(bound(data[1]))
    guard.check()
    before = state(model, optimizer)
    model.act.mode = "log"
    loss = guard.step(bound(data[2]))  # not read yet: returns the (NaN) loss
    assert math.isnan(loss.item())
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(bound(data[3]))  # reads step 3's flag first, replays step 3 (still faulty), raises
    model.act.mode = ""
    assert info.value.step == 3 and info.value.op == "aten.log.default" and info.value.module == "act"
    assert info.value.deferred is True
    assert "deferred: step 3's check was read after the step (TrainingGuard(deferred=True))" in str(
        info.value
    )
    assert_bitwise(before, state(model, optimizer))


def test_deferred_skip_equals_a_run_without_that_batch_and_check_reads_the_last_step():
    data = batches(5)
    m1, o1 = setup(fused=True)
    m2 = copy.deepcopy(m1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    torch.manual_seed(3)
    guard = cg.TrainingGuard(m1, o1, on_nan="skip", deferred=True)
    with pytest.warns(RuntimeWarning, match="training step 5: "):
        run(m1, o1, data, guard, fault_at=5)
        guard.check()
    assert [e.step for e in guard.skipped] == [5]
    torch.manual_seed(3)
    run(m2, o2, data[:4])
    s1, s2 = state(m1, o1), state(m2, o2)
    assert_bitwise(s1, s2)


# -- GradScaler, accumulation, torch.compile ----------------------------------------------


@pytest.mark.locked
def test_a_step_the_scaler_skips_for_inf_is_not_a_finding():
    model, optimizer = setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=3e38)
    guard = cg.TrainingGuard(model, optimizer, scaler=scaler)
    data = batches(2)

    def closure_scaled(batch):
        def closure():
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(batch[0]).float(), batch[1])
            scaler.scale(loss).backward()  # 3e38 * grads overflows float32: Inf gradients
            return loss

        return closure

    before = state(model, optimizer)
    loss = guard.step(closure_scaled(data[0]))
    assert math.isfinite(loss.item()) and not guard.stepped and guard.scaler_skips == 1
    assert scaler.get_scale() == float(torch.tensor(3e38)) / 2 and guard.skipped == []
    # as GradScaler's own skip: no optimizer step; the forward's BatchNorm update stays
    params = {k for k in before if k.startswith("model.") and ".bn.running" not in k and "batches" not in k}
    assert_bitwise({k: before[k] for k in params}, {k: state(model, optimizer)[k] for k in params})
    assert optimizer.state == {}
    scaler.update(2.0**8)
    guard.step(closure_scaled(data[1]))
    assert guard.stepped and guard.scaler_skips == 1
    # a non-finite loss is a finding, and the scaler is left as it was
    model.act.mode = "log"
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure_scaled(data[0]))
    model.act.mode = ""
    assert info.value.op == "aten.log.default" and info.value.module == "act"
    assert scaler.get_scale() == 2.0**8
    guard.step(closure_scaled(data[1]))
    assert guard.stepped


def accumulating(model, optimizer, micro):
    """Gradient accumulation: one closure (one guard.step) per optimizer step, every micro-batch in it."""

    def closure():
        optimizer.zero_grad()
        total = 0.0
        for x, y in micro:
            loss = F.mse_loss(model(x), y) / len(micro)
            loss.backward()
            total = total + loss.detach()
        return total

    return closure


def test_gradient_accumulation_one_guard_step_per_optimizer_step():
    data = batches(12)
    groups = [data[i : i + 3] for i in range(0, 12, 3)]
    m1, o1 = setup()
    m2 = copy.deepcopy(m1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    torch.manual_seed(5)
    guard = cg.TrainingGuard(m1, o1, on_nan="skip")
    calls = {"n": 0}
    original = m1.act.forward

    def second_micro_batch_of_step_2(x):
        calls["n"] += 1
        m1.act.mode = "log" if calls["n"] == 5 else ""  # step 2 = calls 4..6; the replay is call 7
        return original(x)

    m1.act.forward = second_micro_batch_of_step_2
    with pytest.warns(RuntimeWarning, match="training step 2: "):
        for g in groups:
            guard.step(accumulating(m1, o1, g))
    assert [e.op for e in guard.skipped] == [None] and guard.skipped[0].classification == "transient"
    torch.manual_seed(5)
    for g in groups[:1] + groups[2:]:
        accumulating(m2, o2, g)()
        o2.step()
    assert_bitwise(state(m1, o1), state(m2, o2))


@pytest.mark.locked
def test_gradient_accumulation_names_the_producer_in_a_micro_batch():
    model, optimizer = setup()
    guard = cg.TrainingGuard(model, optimizer)
    model.act.mode = "backward"
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(accumulating(model, optimizer, batches(3)))
    assert info.value.phase == "backward" and info.value.module == "act"


# -- CUDA: the syncs, counted by torch itself (skipped without a GPU) ---------------------------


def cuda_syncs(fn) -> int:
    """How many synchronizing CUDA calls ``fn`` makes (torch's sync debug mode, as warnings)."""
    import warnings

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


@requires_cuda
@pytest.mark.parametrize("deferred", [False, True])
def test_cuda_healthy_step_syncs_once_or_never_deferred(deferred):
    model, optimizer = setup(fused=True)
    model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = cg.TrainingGuard(model, optimizer, deferred=deferred)
    data = [(x.cuda(), y.cuda()) for x, y in batches(4)]
    guard.step(closure_for(model, optimizer, data[0]))
    guard.step(closure_for(model, optimizer, data[1]))
    plain = cuda_syncs(lambda: (closure_for(model, optimizer, data[2])(), optimizer.step()))
    guarded = cuda_syncs(lambda: guard.step(closure_for(model, optimizer, data[3])))
    assert guarded - plain == (0 if deferred else 1), (plain, guarded)


@requires_cuda
def test_cuda_bad_step_is_named_and_nothing_is_lost():
    model, optimizer = setup()
    model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = cg.TrainingGuard(model, optimizer)
    data = [(x.cuda(), y.cuda()) for x, y in batches(3)]
    for b in data[:2]:
        guard.step(closure_for(model, optimizer, b))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.cuda.get_rng_state()
    model.act.mode = "log"
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure_for(model, optimizer, data[2]))
    model.act.mode = ""
    assert info.value.op == "aten.log.default" and info.value.module == "act"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.cuda.get_rng_state(), rng)


# -- bad arguments ---------------------------------------------------------------------------


def test_bad_arguments_are_refused():
    model, optimizer = setup()
    with pytest.raises(ValueError, match=r"^TrainingGuard: on_nan must be 'raise' or 'skip', got 'ignore'$"):
        cg.TrainingGuard(model, optimizer, on_nan="ignore")
    with pytest.raises(TypeError, match=r"^TrainingGuard: model must be an nn.Module, got function$"):
        cg.TrainingGuard(lambda x: x, optimizer)
    with pytest.raises(
        TypeError, match=r"^TrainingGuard: optimizer must be a torch.optim.Optimizer, got list$"
    ):
        cg.TrainingGuard(model, [])
    with pytest.raises(ValueError, match=r"^TrainingGuard\(deferred=True\) needs an optimizer that skips"):
        cg.TrainingGuard(model, optimizer, deferred=True)
    with pytest.raises(TypeError, match=r"^TrainingGuard.step: closure must be callable, got int$"):
        cg.TrainingGuard(model, optimizer).step(3)
