"""watch: a NaN/Inf born in ``optimizer.step()`` is a phase of its own, named with the optimizer,
its step, the parameter, the state it went into, the magnitudes that made it, the learning rate
and the losses before it (issue 47, point 1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import cublas_guard_ext as cg
from cublas_guard_ext.errors.optimizer_step import STEP_WRITES_OP

from helpers.watch_models import nothing_left


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.emb(x)))


def _step(model: nn.Module, opt: torch.optim.Optimizer, grad: float, steps: int = 1) -> None:
    """Forward, backward, then every gradient of emb.weight set to `grad` (finite), then step."""
    for _ in range(steps):
        loss = model(torch.ones(3, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        with torch.no_grad():
            model.emb.weight.grad.fill_(grad)
        opt.step()


ADAM_VARIANTS = [
    pytest.param({"foreach": False}, id="single-tensor"),
    pytest.param({"foreach": True}, id="foreach"),
    pytest.param({"fused": True}, id="fused"),
]


@pytest.mark.parametrize("kwargs", ADAM_VARIANTS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_adamw_second_moment_overflow_names_the_optimizer_parameter_and_state(kwargs, mode):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=5.0, **kwargs)
    _step(model, opt, 1.0)  # a clean step first: the finding's step is 2
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode=mode):
            _step(model, opt, 1e21)  # (1 - beta2) * grad**2 = 1e39 > float32's 3.4e38
    err = info.value
    assert err.phase == "optimizer step" and err.module is None
    assert err.optimizer == "AdamW" and err.optimizer_step == 2
    assert err.parameter == "emb.weight" and err.state == "exp_avg_sq"
    assert err.posinf_count > 0 and err.nan_count == 0
    assert err.grad_absmax == pytest.approx(1e21, rel=1e-6)
    assert err.lr == 5.0 and err.state_dtype == "float32"
    assert err.loss_history and len(err.loss_history) == 1
    text = str(err)
    assert "AdamW.step() (optimizer step, step 2) produced" in text
    assert err.op == STEP_WRITES_OP  # torch's own optimizer: unhooked, judged when step() returned
    assert "judged when step() returned: exp_avg_sq of parameter 'emb.weight' was finite before" in text
    assert err.reached == "AdamW's state exp_avg_sq of parameter 'emb.weight'"
    assert "into exp_avg_sq of parameter 'emb.weight'" in text
    assert "1.000e+21 squared is 1.000e+42, past the float32 range 3.403e+38" in text
    assert "clip_grad_norm_(model.parameters(), max_norm=1.0)" in text
    assert "lr=5 is far above AdamW's usual 1e-4 to 1e-3" in text
    assert "?" not in text and "(forward)" not in text and "allow=" not in text
    nothing_left()


def test_sgd_momentum_buffer_overflow_names_momentum_buffer():
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=False)
    _step(model, opt, 3e38)  # the buffer starts as a copy of the gradient: finite
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            _step(model, opt, 3e38)  # 0.9 * 3e38 + 3e38 overflows
    err = info.value
    assert err.phase == "optimizer step" and err.optimizer == "SGD"
    assert err.parameter == "emb.weight" and err.state == "momentum_buffer"
    assert err.hyper["momentum"] == 0.9
    assert err.optimizer_step is None and err.steps_watched >= 1  # SGD keeps no step count
    assert "lower the learning rate: lr=0.001 now; try lr=0.0001" in str(err)
    assert "3.000e+38 is near the float32 limit" in str(err)


def test_sgd_update_overflowing_the_parameter_names_the_parameter_itself():
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e30)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            _step(model, opt, 1e10)  # weight - 1e30 * 1e10 overflows
    err = info.value
    assert err.phase == "optimizer step" and err.state == "the parameter"
    assert err.parameter == "emb.weight"
    assert "into the parameter 'emb.weight'" in str(err)
    assert err.reached == "the parameter 'emb.weight', written by SGD.step()"
    nothing_left()


def test_the_loss_history_shows_the_divergence_and_a_scheduler_changes_nothing():
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            for i, grad in enumerate((1.0, 1.0, 1e21)):
                with torch.no_grad():
                    model.head.bias.fill_(10.0**i)  # the loss grows about 100x each step
                _step(model, opt, grad)
                sched.step()
    err = info.value
    assert err.optimizer == "Adam" and err.optimizer_step == 3 and err.lr == 0.25
    assert len(err.loss_history) == 3 and err.loss_history[-1] > 10 * err.loss_history[0]
    assert "the run diverged before the first Inf (the loss grew" in str(err)


def test_a_birth_after_the_step_is_not_attributed_to_it():
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            _step(model, opt, 1.0)
            out = model(torch.ones(3, 4))
            (out - 1e30 * torch.ones(3, 2) * 1e30).sum().backward()  # the loss: outside, forward
    err = info.value
    assert err.phase == "forward" and err.optimizer is None
    assert "outside any module" in str(err)


def test_under_a_training_guard_the_finding_quotes_its_losses_and_gradient_norms():
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=5.0)
    guard = cg.TrainingGuard(model, opt, history=4)
    grads = iter([1.0, 2.0, 3.0, 1e21])

    def closure() -> torch.Tensor:
        loss = model(torch.ones(3, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        with torch.no_grad():
            model.emb.weight.grad.fill_(next(grads))
        return loss

    for _ in range(3):  # unwatched steps: the guard keeps them, watch does not see them
        guard.step(closure)
    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(model, mode="sync"):
        guard.step(closure)
    err = info.value
    assert err.optimizer == "AdamW" and err.state == "exp_avg_sq" and err.optimizer_step == 4
    assert len(err.loss_history) == 4 and len(err.grad_norm_history) == 4
    # emb.weight's 32 gradient values set to g (1, 2, 3, 1e21) dominate: about sqrt(32) g
    assert err.grad_norm_history[0] == pytest.approx(32**0.5, rel=0.01)
    assert err.grad_norm_history[0] < err.grad_norm_history[1] < err.grad_norm_history[2] < 100
    assert err.grad_norm_history[3] > 1e21  # inf: the guard's norm is float32, and 1e42 is not
    text = str(err)
    assert "recent losses (TrainingGuard's steps, oldest first): " in text
    assert "recent gradient norms (TrainingGuard's steps, oldest first): 5.6" in text
    nothing_left()
