"""Inside a watch block a SafeLinear refusal never advises running under watch (issue 47, point 4):
a value watch saw born is raised as watch's finding at the refusal, in either mode; one it did
not see born (made before the block) is refused with advice about where else it came from."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import cublas_guard_ext as cg

from helpers.watch_models import nothing_left


class Carried(nn.Module):
    """Adds a plain attribute made before the block (no parameter, no buffer: no entry check)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.fc = cg.SafeLinear(4, 4)
        self.table = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.table)


class Masked(nn.Module):
    """Softmax over a row of -inf (born inside the block), then a guarded layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = cg.SafeLinear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(2, 4, dtype=torch.bool)
        mask[0] = True
        return self.fc(x.masked_fill(mask, float("-inf")).softmax(-1))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_refusal_inside_watch_does_not_advise_watch(mode):
    model = Carried(torch.tensor([float("nan"), 0.0, 0.0, 0.0]))
    with pytest.raises(cg.NonFiniteInputError) as info:
        with cg.watch(model, mode=mode):
            model(torch.ones(2, 4))
    text = str(info.value)
    assert info.value.watch_on is True
    assert "cublas_guard_ext.watch(model)" not in text and "run the model under" not in text
    assert "watch is on and no op in its block made these values from finite ones" in text
    nothing_left()


def test_the_same_refusal_outside_watch_still_advises_it():
    model = Carried(torch.tensor([float("nan"), 0.0, 0.0, 0.0]))
    with pytest.raises(cg.NonFiniteInputError) as info:
        model(torch.ones(2, 4))
    assert "run the model under cublas_guard_ext.watch(model)" in str(info.value)
    assert "watch_on" not in info.value.fields


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_refusal_of_a_value_born_in_the_block_yields_to_watch(mode):
    model = Masked()
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode=mode):
            model(torch.ones(2, 4))
    err = info.value
    assert err.op == "aten._softmax.default" and err.nan_count == 4
    assert "which refused it" in err.reached
    nothing_left()
