"""A transient NaN (the replay is finite) is placed when the faulty run was recorded: a checked
step (SilentCorruptionChecks(check_every=1)) names the first module and phase where the run
and its rerun differ; a watch session around the faulty run names its birth."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg


class Once(nn.Module):
    """A one-shot NaN in its forward (``armed``): the next call is clean, so the replay is finite."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            return x + torch.log(-x.abs() - 1.0)
        return x


def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Once(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def closure_for(model, opt, watched: bool = False):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)

    def closure():
        opt.zero_grad()
        if watched:
            with cg.watch(model):
                loss = F.mse_loss(model(x), y)
        else:
            loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


def test_a_transient_nan_on_a_checked_step_is_placed_at_its_module():
    model, opt = setup()
    checks = cg.SilentCorruptionChecks(check_every=1, replica_every=None, spike_threshold=None)
    guard = cg.TrainingGuard(model, opt, silent_corruption=checks)
    guard.step(closure_for(model, opt))
    model[2].armed = True
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure_for(model, opt))
    err = info.value
    assert err.classification == "transient" and err.placed_by == "record"
    assert (err.module, err.phase, err.what) == ("2", "forward", "output")
    assert "placed: output in module '2' (forward): the faulty run was recorded module by module" in str(err)
    assert "(here module '2', forward)" in str(err)


def test_a_transient_nan_without_a_record_is_not_placed():
    model, opt = setup()
    guard = cg.TrainingGuard(model, opt)
    model[2].armed = True
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure_for(model, opt))
    assert info.value.classification == "transient" and info.value.module is None
    assert "placed_by" not in info.value.fields and "placed:" not in str(info.value)


@pytest.mark.locked  # watch places it: it needs the version-locked library
def test_a_transient_nan_under_a_watch_session_is_placed_at_its_birth():
    model, opt = setup()
    guard = cg.TrainingGuard(model, opt)
    model[2].armed = True
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure_for(model, opt, watched=True))
    err = info.value
    assert err.classification == "transient" and err.placed_by == "watch"
    assert (err.op, err.module, err.phase) == ("aten.log.default", "2", "forward")
    assert "placed: aten.log.default in module '2' (forward): the watch session around the faulty run" in str(
        err
    )
