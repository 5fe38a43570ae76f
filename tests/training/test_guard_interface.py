"""TrainingGuard's interface for integrations (docs/training-guard.md, "For integrations"):
``begin``, ``is_bad``, ``apply`` and ``reject`` make the same run as ``step``; ``restore``
undoes a closure; ``collective``, ``history``, ``batch`` and ``parameters`` say what they
document. tests/package/test_training_privates.py holds the package to this interface."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext.training.guard import NON_FINITE_REFUSALS

NAN = float("nan")


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.25), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batches(n: int, nan_at: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(1, n + 1):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)
        if i == nan_at:
            x[2, 5] = NAN
        out.append((x, y))
    return out


def closure_for(model, opt, batch):
    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(batch[0]), batch[1])
        loss.backward()
        return loss

    return closure


def by_hand(guard, closure):
    """What an integration's hooks do: begin before the forward, is_bad after the backward,
    then apply or reject."""
    rng = guard.begin()
    try:
        loss = closure()
    except NON_FINITE_REFUSALS as refusal:
        return guard.reject(closure, rng, refusal=refusal)
    if guard.is_bad(loss):
        return guard.reject(closure, rng, loss)
    return guard.apply(loss)


def run(model, opt, data, hand: bool, on_nan: str = "skip"):
    guard = cg.TrainingGuard(model, opt, on_nan=on_nan)
    torch.manual_seed(7)
    losses = []
    for batch in data:
        closure = closure_for(model, opt, batch)
        with pytest.warns(RuntimeWarning) if batch[0].isnan().any() else _nothing():
            loss = by_hand(guard, closure) if hand else guard.step(closure)
        losses.append(None if loss is None else float(loss.detach()))
    return guard, losses


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def state_of(model, opt):
    return [t.clone() for t in model.state_dict().values()] + [
        s["momentum_buffer"].clone() for s in opt.state.values()
    ]


@pytest.mark.parametrize("guarded", [False, True], ids=["nn.Linear", "replace_linear"])
def test_begin_is_bad_apply_reject_make_the_same_run_as_step(guarded):
    """A NaN batch at step 3, skipped: the hand-driven run equals step()'s bitwise (parameters,
    buffers, momentum, losses, RNG stream after) and its error says the same words. Under
    replace_linear the NaN is a guarded layer's refusal: reject(refusal=) is that path."""
    data = batches(5, nan_at=3)
    runs = []
    for hand in (False, True):
        model, opt = make()
        if guarded:
            model = cg.replace_linear(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        guard, losses = run(model, opt, data, hand)
        runs.append((guard, losses, state_of(model, opt), torch.rand(4)))
    (g_step, l_step, s_step, r_step), (g_hand, l_hand, s_hand, r_hand) = runs
    assert (
        l_hand == l_step and l_step[2] is None and all(v is not None for i, v in enumerate(l_step) if i != 2)
    )
    assert all(torch.equal(a, b) for a, b in zip(s_hand, s_step, strict=True))
    assert torch.equal(r_hand, r_step)
    assert [e.step for e in g_hand.skipped] == [e.step for e in g_step.skipped] == [3]
    assert str(g_hand.skipped[0]) == str(g_step.skipped[0])
    if guarded:
        assert isinstance(g_hand.skipped[0].__cause__, NON_FINITE_REFUSALS)
        assert g_hand.history.read()[2]["refused_by"] == g_step.history.read()[2]["refused_by"] == "0"
    assert g_hand.steps == g_step.steps == 5


def test_reject_raises_like_step_with_the_cause_and_nothing_applied():
    model = cg.replace_linear(make()[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = cg.TrainingGuard(model, opt, on_nan="raise")
    x, y = batches(1, nan_at=1)[0]
    before = state_of(model, opt)
    with pytest.raises(cg.NonFiniteStepError) as info:
        by_hand(guard, closure_for(model, opt, (x, y)))
    assert info.value.fields["step"] == 1 and info.value.fields["refused_by"] == "0"
    assert isinstance(info.value.__cause__, NON_FINITE_REFUSALS)
    assert all(torch.equal(a, b) for a, b in zip(state_of(model, opt), before, strict=True))
    assert all(p.grad is None for p in model.parameters())


class CountingSGD(torch.optim.SGD):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.zero_grad_calls: list[bool] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grad_calls.append(set_to_none)
        super().zero_grad(set_to_none)


@pytest.mark.parametrize("optimizer", [False, True])
def test_restore_undoes_the_closure(optimizer):
    """RNG states (torch, Python, NumPy), every buffer (BatchNorm's statistics) back; every
    gradient None; the optimizer's zero_grad(set_to_none=True) only with optimizer=True."""
    model, _ = make()
    opt = CountingSGD(model.parameters(), lr=0.1)
    guard = cg.TrainingGuard(model, opt)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    rng = guard.begin()
    draws = (torch.rand(3), random.random(), np.random.rand())
    closure_for(model, opt, batches(1, None)[0])()  # writes BN statistics, draws dropout masks
    assert any(not torch.equal(buffers[k], v) for k, v in model.named_buffers())
    opt.zero_grad_calls.clear()
    guard.restore(rng, optimizer=optimizer)
    assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())
    assert all(p.grad is None for p in model.parameters())
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(again[0], draws[0]) and again[1:] == draws[1:]
    assert opt.zero_grad_calls == ([True] if optimizer else [])


def test_collective_without_a_group_is_local():
    model, opt = make()
    guard = cg.TrainingGuard(model, opt, process_group=None)
    c = guard.collective
    flag = torch.ones(())
    assert (c.group, guard.group, c.rank, c.world) == (None, None, None, None)
    assert c.agree(flag) is flag and c.gather({"a": 1}) == [{"a": 1}]


def test_collective_on_a_one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model, opt = make()
        guard = cg.TrainingGuard(model, opt, process_group=dist.group.WORLD)
        c = guard.collective
        assert guard.group is c.group is dist.group.WORLD and (c.rank, c.world) == (0, 1)
        assert torch.equal(c.agree(torch.tensor([0.0, 2.0])), torch.tensor([0.0, 2.0]))
        assert c.gather({"rank": c.rank}) == [{"rank": 0}]
    finally:
        dist.destroy_process_group()


def test_history_keeps_the_norm_of_the_latest_step_and_loads_what_it_read():
    model, opt = make()
    guard = cg.TrainingGuard(model, opt, history=3)
    torch.manual_seed(0)
    for batch in batches(4, None):
        guard.step(closure_for(model, opt, batch))
    grads = torch.cat([p.grad.double().flatten() for p in model.parameters()])  # the last step's
    noted = guard.history.grad_norm(4)
    assert noted is not None
    torch.testing.assert_close(noted.double(), torch.linalg.vector_norm(grads), rtol=1e-6, atol=0)
    assert guard.history.grad_norm(3) is None  # not the latest entry
    read = guard.history.read()
    assert [e["step"] for e in read] == [2, 3, 4] and guard.history is guard._history
    small = cg.TrainingGuard(model, None, history=2)
    small.history.load(read)
    assert [e["step"] for e in small.history.read()] == [3, 4]
    none = cg.TrainingGuard(model, None, history=0)
    none.history.load(read)
    assert none.history.read() == []


def test_parameters_are_the_optimizers_in_group_order_else_the_trainable_ones():
    model, _ = make()
    first, last = model[0], model[4]
    first.bias.requires_grad_(False)
    opt = torch.optim.SGD([{"params": last.parameters()}, {"params": [first.weight]}], lr=0.1)
    assert cg.TrainingGuard(model, opt).parameters() == [last.weight, last.bias, first.weight]
    trainable = [p for p in model.parameters() if p is not first.bias]
    assert cg.TrainingGuard(model, None).parameters() == trainable


def test_batch_is_this_steps_sample_ids():
    model, opt = make()
    guard = cg.TrainingGuard(model, opt)
    seen = []
    x, y = batches(1, None)[0]

    def closure():
        seen.append(guard.batch.ids if guard.batch is not None else None)
        return closure_for(model, opt, (x, y))()

    guard.step(closure, sample_ids=list(range(10, 16)))
    guard.step(closure)
    assert seen == [tuple(range(10, 16)), None]


def test_the_interface_is_documented():
    import inspect

    guard_cls = cg.TrainingGuard
    for name in ("begin", "is_bad", "apply", "reject", "restore", "parameters"):
        assert inspect.getdoc(getattr(guard_cls, name)), name
    for name in ("group", "history", "batch"):
        assert inspect.getdoc(getattr(guard_cls, name)), name
    from cublas_guard_ext.training.state import Collective, StepHistory

    assert all(inspect.getdoc(getattr(Collective, n)) for n in ("rank", "world", "agree", "gather"))
    assert all(inspect.getdoc(getattr(StepHistory, n)) for n in ("mark", "grad_norm", "read", "load"))
