"""torchao's Float8Linear under replace_linear: FP8 kept (bitwise), its three GEMMs' operands
checked (non-finite values, the scale, saturation and flush to zero), restore_linear's way back."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

import cublas_guard_ext as cge
from cublas_guard_ext import fp8
from cublas_guard_ext.errors.fp8 import Fp8NonFiniteError, Fp8RangeError, Fp8RangeWarning

torchao = pytest.importorskip("torchao")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _model(recipe: str = "tensorwise", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).to(torch.bfloat16)
    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out.float() ** 2).mean().backward()
    return out.detach(), x.grad, [p.grad for p in model.parameters()]


@pytest.fixture(autouse=True)
def _thresholds():
    saved = (fp8.THRESHOLDS.saturate, fp8.THRESHOLDS.flush, fp8.THRESHOLDS.strict)
    fp8.set_thresholds(strict=False)
    yield
    fp8.set_thresholds(saturate=saved[0], flush=saved[1], strict=saved[2])


@pytest.mark.parametrize("recipe", RECIPES)
def test_guarded_float8_is_bitwise_torchao(recipe: str) -> None:
    plain = _model(recipe)
    guarded = cge.replace_linear(copy.deepcopy(plain))
    assert [type(m).__name__ for m in guarded if isinstance(m, nn.Linear)] == ["GuardedFloat8Linear"] * 2
    assert sorted(cge.coverage(guarded).guarded) == ["0", "2"]
    x = torch.randn(4, 32, 64, dtype=torch.bfloat16)
    ref, guarded_out = _step(plain, x), _step(guarded, x)
    assert torch.equal(ref[0], guarded_out[0])
    assert torch.equal(ref[1], guarded_out[1])
    for a, b in zip(ref[2], guarded_out[2]):
        assert torch.equal(a, b)
    assert guarded[0].recipe == recipe
    restored = cge.restore_linear(guarded)
    assert [type(m) for m in restored if isinstance(m, nn.Linear)] == [Float8Linear, Float8Linear]
    assert cge.coverage(restored).guarded == []
    assert "torchao Float8Linear, not guarded" in cge.coverage(restored).left[0][2]


def test_inf_in_input_names_the_layer_gemm_and_scale() -> None:
    model = cge.replace_linear(_model())
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    x[3, 5] = float("inf")
    with pytest.raises(Fp8NonFiniteError) as info:
        model(x)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, cge.GuardError)
    assert (err.layer, err.gemm, err.operand, err.recipe) == ("0", "forward", "input", "tensorwise")
    assert (err.nan_count, err.posinf_count, err.neginf_count) == (0, 1, 0)
    assert err.first_bad_index == 3 * 64 + 5 and err.amax == float("inf") and err.scale == 0.0
    text = str(err)
    assert "layer '0', forward GEMM, operand input (e4m3fn, tensorwise): 0 NaN, 1 +Inf, 0 -Inf of 512" in text
    assert "input[3, 5] (inf)" in text and "scale = max / amax = 0" in text and "watch" in text


@pytest.mark.slow  # the replay runs in a fresh process
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_refused_operand_writes_a_capsule_whose_replay_reruns_the_cast(recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLAS_GUARD_CAPSULE_DIR", str(tmp_path))
    model = cge.replace_linear(_model(recipe))
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    x[3, 5] = float("inf")
    with pytest.raises(Fp8NonFiniteError) as info:
        model(x)
    path = info.value.capsule
    assert path is not None and path in str(info.value)
    data = cge.capsule.load(path)
    assert data["layer"] == "0" and data["phase"] == "the cast of input for the forward GEMM"
    assert data["float8_cast"]["where"]["recipe"] == recipe and data["float8_cast"]["values_kept"]
    result = cge.replay(path)
    assert result["reproduced"], result["verdict"]
    rows = "1 of 1 scales" if recipe == "tensorwise" else "1 of 8 scales"  # the Inf's row alone
    assert f"torchao's cast of the input alone: amax inf, {rows} not finite and positive" in result["verdict"]
    # scale 0: Inf * 0 is the one NaN code, every other value of the tensor (or of the row) is 0
    zeros = 511 if recipe == "tensorwise" else 63
    assert re.search(r"1 of 512 float8 codes NaN and (\d+) zero", result["verdict"])
    assert int(re.search(r"NaN and (\d+) zero", result["verdict"]).group(1)) >= zeros


def test_nan_in_grad_output_is_named_in_the_backward_gemm() -> None:
    model = cge.replace_linear(_model("rowwise"))
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    out = model(x)
    grad = torch.ones_like(out)
    grad[1, 2] = float("nan")
    with pytest.raises(Fp8NonFiniteError) as info:
        out.backward(grad)
    err = info.value
    assert (err.layer, err.gemm, err.operand, err.recipe) == ("2", "grad_input", "grad_output", "rowwise")
    assert err.nan_count == 1 and err.first_bad_index == 1 * 32 + 2
    assert "in the backward pass" in str(err)


def test_one_outlier_flushing_the_rest_warns_and_strict_raises() -> None:
    model = cge.replace_linear(_model())
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    x[0, 0] = 1e30
    with pytest.warns(Fp8RangeWarning) as record:
        model(x)
    text = str(record[0].message)
    assert "layer '0', forward GEMM, operand input (e4m3fn, tensorwise)" in text
    assert "flush to zero" in text and "rowwise" in text and "scale 4.479e-28" in text
    fp8.set_thresholds(strict=True)
    with pytest.raises(Fp8RangeError) as info:
        model(x)
    assert info.value.flushed == 511 and info.value.nonzero == 512  # every value but the outlier
    assert info.value.flushed_fraction == pytest.approx(511 / 512)


def test_flush_count_is_exactly_what_the_cast_rounds_to_zero() -> None:
    from cublas_guard_ext.fp8.checks import flush_counts, stats_of

    fmt = fp8.format_of(torch.float8_e4m3fn)
    torch.manual_seed(3)
    x = torch.randn(4096) * torch.logspace(-12, 0, 4096)
    x[::7] = 0.0  # exact zeros are not flushed
    scale = torch.tensor(448.0) / x.abs().max()
    codes = (x * scale).to(torch.float8_e4m3fn)
    expected = int(((codes.float() == 0) & (x != 0)).sum())
    zero_codes = int(stats_of(x, x.abs().max(), scale, codes, fmt).tolist()[2])
    assert 0 < expected == flush_counts(x, zero_codes, exact=True)[0]
    assert flush_counts(x, zero_codes, exact=False)[0] == expected  # above the threshold: counted
    few = x.clone()
    few[: 4096 - 64] = 1.0  # 64 tiny values left: under the threshold, x is not read again
    codes = (few * scale).to(torch.float8_e4m3fn)
    assert flush_counts(few, int((codes.float() == 0).sum()), exact=False) == (0, -1)


def test_clean_steps_do_not_warn_at_the_default_thresholds() -> None:
    model = cge.replace_linear(_model("rowwise"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Fp8RangeWarning)
        for _ in range(3):
            _step(model, torch.randn(16, 64, dtype=torch.bfloat16))
            opt.step()
            opt.zero_grad()


def test_async_mode_raises_at_the_next_call_or_check() -> None:
    model = cge.replace_linear(_model(), mode="async")
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    x[0, 1] = float("nan")
    hidden = model[0](x)  # no raise: the verdict is read later
    assert torch.isnan(hidden).all()
    with pytest.raises(Fp8NonFiniteError, match="layer '0', forward GEMM, operand input.*1 NaN"):
        fp8.check()
    fp8.check()  # read once
    with pytest.raises(Fp8NonFiniteError, match="layer '0'"):
        model(x)  # layer 0's verdict, read at layer 2's call


def test_mode_off_checks_nothing() -> None:
    model = cge.replace_linear(_model(), mode="off")
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    x[0, 0] = float("inf")
    assert torch.isnan(model(x)).all()  # torchao's own behaviour: scale 0, all NaN


def test_torchao_older_than_the_floor_leaves_the_model_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    monkeypatch.setattr(torchao, "__version__", "0.16.0")
    with pytest.warns(UserWarning, match=r"torchao 0.16.0 is older than 0.18.0.*left unguarded \(2\)"):
        cge.replace_linear(model)
    assert "torchao 0.16.0 is older than 0.18.0" in cge.coverage(model).left[0][2]
    assert [type(m) for m in model if isinstance(m, nn.Linear)] == [Float8Linear, Float8Linear]


def test_named_float8_layer_only() -> None:
    model = cge.replace_linear(_model(), which=["2"])
    assert [type(m).__name__ for m in model if isinstance(m, nn.Linear)] == [
        "Float8Linear",
        "GuardedFloat8Linear",
    ]


@pytest.mark.parametrize("recipe", RECIPES)
def test_direct_checks_pass_torchao_clean_and_name_its_nan(recipe: str) -> None:
    plain = _model(recipe)
    guarded = cge.replace_linear(copy.deepcopy(plain))
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    ref = _step(plain, x)
    with fp8.checked_fp8():
        unguarded_checked, guarded_checked = _step(plain, x), _step(guarded, x)
        bad = x.clone()
        bad[0, 0, 0] = float("inf")
        with pytest.raises(Fp8NonFiniteError) as info:
            plain(bad)  # unguarded Float8Linear: the NaN its zero scale made is named at the cast
        assert info.value.op == "cast" and info.value.nan_count > 0
        with pytest.raises(Fp8NonFiniteError) as info:
            guarded(bad)  # guarded: the layer's own check, not the cast's
        assert info.value.layer == "0" and info.value.posinf_count == 1
    for a, b in zip(
        (ref[0], ref[1], *ref[2]), (unguarded_checked[0], unguarded_checked[1], *unguarded_checked[2])
    ):
        assert torch.equal(a, b)
    assert torch.equal(ref[0], guarded_checked[0])
