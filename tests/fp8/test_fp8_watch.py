"""watch and FP8 (issue 46, point 5): a NaN/Inf born in a scaled GEMM is placed like any op's; in
consequence mode (``watch(model)``) a saturated cast to float8, where an Inf becomes a finite 448
and would never reach the loss, is the sink that reports the Inf's birth; float8 outputs are read
(ATen has no CPU isfinite for them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cublas_guard_ext as cg

pytestmark = pytest.mark.locked  # watch

E4M3 = torch.float8_e4m3fn
BIG = torch.tensor([3e38, 1.0, -3e38])  # x 10: +Inf and -Inf, born in the mul


def _finding(fn, model: nn.Module | None = None) -> cg.NonFiniteOutputError:
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model if model is not None else nn.Identity(), mode="sync"):
            fn()
    return info.value


def _reached(err: Exception) -> list[str]:
    return [line.strip() for line in str(err).splitlines() if line.strip().startswith("reached:")]


def test_a_cast_to_e4m3_is_the_sink_of_an_inf_born_before_it():
    err = _finding(lambda: (BIG * 10).to(E4M3))
    assert err.op == "aten.mul.Tensor" and (err.posinf_count, err.neginf_count) == (1, 1)
    assert _reached(err) == [
        "reached: the cast to float8_e4m3fn (aten._to_copy), a format without Inf: +Inf becomes 448 and "
        "-Inf -448 there (torch >= 2.12 saturates; 2.11 made them NaN), so the value is lost"
    ]


def _next_steps(err: Exception) -> str:
    text = str(err)
    return text[text.index("\nNext: ") :]


def test_the_next_step_of_a_swallowed_inf_is_its_birth_not_allow():
    err = _finding(lambda: (BIG * 10).to(E4M3))
    steps = _next_steps(err)
    assert steps.startswith(
        "\nNext: fix the values here, where they were born, not at the cast: float8_e4m3fn has no Inf, "
        "so the cast saturated them to +-448 and training would have gone on with them"
    )
    assert "allow=" not in steps  # a value the cast clipped is lost, not intended
    text = str(err)  # where the values went is said before what to do
    assert text.index("\n  reached: the cast to float8_e4m3fn") < text.index("\nNext: ")


class _Times10(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 10


def test_an_inf_no_float8_cast_swallowed_keeps_the_generic_steps():
    model = _Times10()
    err = _finding(lambda: model(BIG).to(torch.float8_e5m2), model)  # e5m2 keeps it: the output sinks
    assert "reached: the model's output" in str(err)
    assert "not at the cast" not in str(err) and "allow=" in _next_steps(err)


def test_a_copy_into_an_e4m3_tensor_is_a_sink_too():
    def copy() -> None:
        torch.empty(3, dtype=E4M3).copy_(BIG * 10)

    assert _reached(_finding(copy))[0].startswith(
        "reached: the copy into a float8_e4m3fn tensor (aten.copy_)"
    )


def test_a_cast_to_e5m2_keeps_the_inf_and_is_no_sink():
    with cg.watch(nn.Identity(), mode="sync"):
        out = (BIG * 10).to(torch.float8_e5m2)  # e5m2 has Inf: nothing is lost, nothing reached yet
    assert out.float().isinf().sum() == 2


def test_a_clamp_to_another_range_is_no_sink_and_a_clean_cast_is_silent():
    with cg.watch(nn.Identity(), mode="sync"):
        clipped = (BIG * 10).clamp(-1e4, 1e4)  # T5's fp16 clamp: a model's choice, not a cast
        clean = torch.randn(64).clamp(-448.0, 448.0).to(E4M3)
    assert torch.isfinite(clipped).all() and torch.isfinite(clean.float()).all()


def test_torchao_float8_linear_names_the_birth_and_the_clamp_that_hid_it():
    pytest.importorskip("torchao")
    from torchao.float8 import convert_to_float8_training

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(self.up(x) * 1e38 * 100.0)  # overflows float32 before down's cast

    torch.manual_seed(0)
    model = convert_to_float8_training(Model())
    err = _finding(lambda: model(torch.randn(16, 32)).sum().backward(), model)
    assert err.op == "aten.mul.Tensor" and err.posinf_count + err.neginf_count > 0
    assert _reached(err) == [
        "reached: aten.clamp to +-448, float8_e4m3fn's range (the first step of a saturated FP8 cast, as "
        "torchao's): +Inf becomes 448 and -Inf -448 there, so the non-finite value is lost"
    ]
    assert _next_steps(err).startswith("\nNext: fix the values here, where they were born, not at the cast")


def test_an_overflow_in_a_scaled_gemm_is_born_there():
    a = torch.full((4, 32), 448.0).to(E4M3)
    b = torch.full((8, 32), 448.0).to(E4M3).t()  # column-major, cuBLASLt's layout
    scale = torch.tensor(1e30)
    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(mode="sync"):  # report="birth"
        torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.float32)
    err = info.value
    assert err.op == "aten._scaled_mm.default" and err.posinf_count == 32
    assert err.dtype == "torch.float32" and err.first_bad_index == 0


def test_the_swallowed_inf_is_typed_under_run_s_checked_casts_too():
    # run --watch also checks every float8 cast (fp8.checked_fp8): naming the sink's format must
    # not cast anything itself, or that check refuses it and the finding arrives untyped.
    from cublas_guard_ext import fp8

    with fp8.checked_fp8():
        err = _finding(lambda: (BIG * 10).to(E4M3))
    assert _next_steps(err).startswith("\nNext: fix the values here, where they were born, not at the cast")
