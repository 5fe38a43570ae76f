"""What ``watch`` says about a grouped GEMM's output: inside the guarded experts, the expert (and
the parameter) of the first bad row; in torch's grouped_mm, that the first bad row is past the
last group end, where grouped_mm leaves its output and input gradient uninitialized by design,
with the fix, instead of blaming the op or the layer that reads them next."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers import moe_models as mm

# A grouped GEMM whose rows past offs[-1] hold NaN, as recycled memory under torch's grouped_mm
# does (the uninitialized memory simulated: written through numpy, which no dispatcher sees, so
# watch sees only this op's output); `poison` >= 0 also puts a NaN in that row. Its argument is
# named offs, as grouped_mm's.
_LIB = torch.library.Library("cublas_guard_moe_test", "FRAGMENT")
_LIB.define("grouped_mm_recycled(Tensor x, Tensor w, Tensor offs, int poison=-1) -> Tensor")

# watch is the version-locked library's.
pytestmark = pytest.mark.locked


def _recycled(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, poison: int = -1) -> torch.Tensor:
    out = F.grouped_mm(x, w, offs=offs)
    values = out.detach().numpy()
    values[int(offs[-1]) :] = float("nan")
    if poison >= 0:
        values[poison, 1] = float("nan")
    return out


_LIB.impl("grouped_mm_recycled", _recycled, "CPU")


class Grouped(torch.nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 16, 8))
        self.op = op

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.w, offs)


def test_rows_past_the_last_group_end_are_named_with_the_fix() -> None:
    model = Grouped(torch.ops.cublas_guard_moe_test.grouped_mm_recycled)
    offs = torch.tensor([4, 4, 9, 12], dtype=torch.int32)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, report="birth"):
            model(torch.randn(16, 16), offs)
    err = info.value
    assert err.past_groups is True and err.groups_end == 12 and err.first_bad_coords == [12, 0]
    text = str(err)
    assert "the first bad row (12) is past the last group end (offs[-1] = 12)" in text
    assert "leaves those rows of its output, and of its input gradient, uninitialized" in text
    assert "Next: zero-fill the rows past offs[-1]" in text and "compact the input" in text


def test_a_bad_row_inside_a_group_names_the_group() -> None:
    model = Grouped(lambda x, w, offs: torch.ops.cublas_guard_moe_test.grouped_mm_recycled(x, w, offs, 6))
    offs = torch.tensor([4, 4, 9, 16], dtype=torch.int32)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, report="birth"):
            model(torch.randn(16, 16), offs)
    err = info.value
    assert err.op == "cublas_guard_moe_test.grouped_mm_recycled.default"
    assert err.expert == 2 and err.expert_rows == [4, 9] and not err.fields.get("past_groups")


def test_torch_grouped_mm_on_the_cpu_leaves_the_tail_uninitialized() -> None:
    """The real op (torch 2.13 runs grouped_mm on the CPU): whether its tail holds NaN depends on
    what the allocator hands back, so this plants NaN in freed memory of the output's size and
    tries a few times; when the tail comes back finite every time, there is nothing to name."""
    x, w = torch.randn(64, 16), torch.randn(4, 16, 32)
    offs = torch.tensor([10, 20, 30, 40], dtype=torch.int32)

    class Model(torch.nn.Module):
        def forward(self, x):
            junk = torch.full((64, 32), float("nan"))
            del junk
            return F.grouped_mm(x, w, offs=offs)

    for _ in range(5):
        try:
            with cg.watch(Model(), report="birth"):
                Model()(x)
        except cg.NonFiniteOutputError as err:
            assert err.op == "aten._grouped_mm.default" and err.past_groups is True
            assert err.groups_end == 40 and err.first_bad_coords[0] >= 40
            return
    pytest.skip("the allocator handed back finite memory every time: nothing uninitialized to name")


def test_a_finding_inside_the_guarded_experts_names_the_expert_and_parameter() -> None:
    model = mm.mixtral()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cg.replace_linear(model)
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj[2].fill_(3e38)  # finite; its products overflow
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model):
            model(torch.tensor([list(range(0, 64, 3))]))
    err = info.value
    assert err.op == "cublas_guard.grouped_linear.default" and err.module == "model.layers.0.mlp.experts"
    assert (err.experts_module, err.parameter, err.expert) == ("model.layers.0.mlp.experts", "down_proj", 2)
    assert "in expert 2 of 'model.layers.0.mlp.experts', parameter down_proj (down_proj[2])" in str(err)
