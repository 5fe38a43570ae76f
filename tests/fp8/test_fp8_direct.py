"""Direct FP8 calls under checked_fp8(): torch._scaled_mm, F.scaled_mm, torch._scaled_grouped_mm
and casts to float8, each failure with its exact error; outside the block torch's own behaviour."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cublas_guard_ext import fp8
from cublas_guard_ext.errors.fp8 import (
    Fp8ArgumentError,
    Fp8NonFiniteError,
    Fp8RangeError,
    Fp8RangeWarning,
    Fp8ScaleError,
)
from cublas_guard_ext.fp8 import direct

E4M3 = torch.float8_e4m3fn
ONE = torch.tensor(1.0)


def _runs(call) -> bool:  # noqa: ANN001
    """Whether this torch's CPU kernels can do ``call()`` at all (torch 2.11's cannot do some)."""
    try:
        call()
    except (RuntimeError, NotImplementedError):
        return False
    return True


# What this torch's own FP8 on the CPU does, where releases differ: eager e4m3 casts saturate
# from torch 2.12 on (pytorch#178817; 2.11 makes Inf NaN), and 2.11's CPU _scaled_mm takes
# per-tensor scales only, with no CPU kernel for F.scaled_mm.
CASTS_SATURATE = float(torch.tensor(float("inf")).to(E4M3).float()) == 448.0


@pytest.fixture(autouse=True)
def _thresholds():
    saved = (fp8.THRESHOLDS.saturate, fp8.THRESHOLDS.flush, fp8.THRESHOLDS.strict)
    fp8.set_thresholds(strict=False)
    direct._WARNED.clear()
    yield
    fp8.set_thresholds(saturate=saved[0], flush=saved[1], strict=saved[2])


def _operands(m: int = 16, k: int = 32, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(m, k).to(E4M3)
    b = torch.randn(n, k).to(E4M3).t()  # column-major, as cuBLASLt wants
    return a, b


def test_the_e4m3_cast_that_swallows_an_inf_is_named() -> None:
    x = torch.randn(4, 8)
    x[2, 3] = float("inf")
    plain = float(x.to(E4M3)[2, 3].float())  # torch: silent either way
    assert plain == 448.0 if CASTS_SATURATE else plain != plain  # 448, or NaN before torch 2.12
    with fp8.checked_fp8(), pytest.raises(Fp8NonFiniteError) as info:
        x.to(E4M3)
    err = info.value
    assert (err.op, err.operand, err.posinf_count, err.first_bad_index) == ("cast", "input", 1, 19)
    text = str(err)
    assert "cast, operand input (e4m3fn): 0 NaN, 1 +Inf, 0 -Inf of 32 values before the float8 cast" in text
    assert "input[2, 3] (inf)" in text and "saturates +/-Inf to +/-448" in text
    assert (
        torch.Tensor.to is direct._installed.get((id(torch.Tensor), "to"), (None, None, torch.Tensor.to))[2]
    )


def test_cast_saturation_warns_then_strict_raises() -> None:
    x = torch.randn(1000)
    x[:20] = 1000.0  # 2% above 448
    with fp8.checked_fp8():
        with pytest.warns(Fp8RangeWarning, match=r"20 of 1000 values \(2.000%\) saturate at \+/-448"):
            x.to(E4M3)
        fp8.set_thresholds(strict=True)
        with pytest.raises(Fp8RangeError) as info:
            x.to(torch.float8_e4m3fn)
        near = torch.full(
            (100,), 463.0
        )  # rounds to 448 anyway (448 + half of the top spacing 32): not clipped
        assert float(near.to(E4M3)[0].float()) == 448.0
    assert info.value.saturated == 20


def test_scaled_mm_infinite_and_zero_scales() -> None:
    a, b = _operands()
    assert torch._scaled_mm(a, b, torch.tensor(float("inf")), ONE, out_dtype=torch.bfloat16).isnan().all()
    with fp8.checked_fp8():
        with pytest.raises(
            Fp8ScaleError, match=r"torch._scaled_mm, operand scale_a: 1 of 1 scale values"
        ) as inf:
            torch._scaled_mm(a, b, torch.tensor(float("inf")), ONE, out_dtype=torch.bfloat16)
        with pytest.raises(Fp8ScaleError) as zero:
            torch._scaled_mm(a, b, ONE, torch.tensor(0.0), out_dtype=torch.bfloat16)
    assert "amax of 0" in str(inf.value) and "amax of Inf" in str(zero.value)
    assert zero.value.operand == "scale_b"


def test_scaled_mm_nan_code_in_an_operand() -> None:
    a, b = _operands()
    a = a.clone()
    a.view(torch.uint8)[3, 4] = 0x7F  # e4m3fn's NaN
    with fp8.checked_fp8(), pytest.raises(Fp8NonFiniteError) as info:
        torch._scaled_mm(a, b, ONE, ONE, out_dtype=torch.bfloat16)
    assert (info.value.operand, info.value.nan_count, info.value.first_bad_index) == ("mat_a", 1, 3 * 32 + 4)
    assert "1 NaN and 0 Inf codes of 512 in the float8 operand" in str(info.value)


def test_scaled_mm_wrong_layout_and_scale_shapes() -> None:
    a, b = _operands()
    row_major_b = b.contiguous()
    assert torch._scaled_mm(a, row_major_b, ONE, ONE, out_dtype=torch.bfloat16).shape == (16, 64)  # CPU: fine
    with fp8.checked_fp8():
        with pytest.raises(
            Fp8ArgumentError, match=r"mat_b \[32, 64\] with strides \(64, 1\) is not column-major"
        ):
            torch._scaled_mm(a, row_major_b, ONE, ONE, out_dtype=torch.bfloat16)
        with pytest.raises(
            Fp8ArgumentError, match=r"scale_a \[16, 2\] and scale_b \[1, 64\] match no float32 recipe"
        ):
            torch._scaled_mm(a, b, torch.ones(16, 2), torch.ones(1, 64), out_dtype=torch.bfloat16)
    rowwise = lambda: torch._scaled_mm(a, b, torch.ones(16, 1), torch.ones(1, 64), out_dtype=torch.bfloat16)  # noqa: E731
    if _runs(rowwise):  # torch 2.11's CPU kernel takes per-tensor scales only
        with fp8.checked_fp8():
            assert rowwise().shape == (16, 64)  # the rowwise recipe's shapes pass the check


def test_scaled_mm_output_overflow() -> None:
    a = torch.full((16, 32), 448.0).to(E4M3)
    b = torch.full((64, 32), 448.0).to(E4M3).t()
    with fp8.checked_fp8(), pytest.raises(Fp8NonFiniteError) as info:
        torch._scaled_mm(a, b, ONE, ONE, out_dtype=torch.float16)  # 448 * 448 * 32 > 65504
    assert info.value.operand == "output" and info.value.posinf_count == 16 * 64
    assert "from finite float8 operands and scales" in str(info.value)


def test_functional_scaled_mm_and_grouped_mm_are_checked() -> None:
    if not hasattr(F, "scaled_mm"):
        pytest.skip("this torch has no F.scaled_mm")
    a, b = _operands()
    tw = F.ScalingType.TensorWise
    if not _runs(lambda: F.scaled_mm(a, b, ONE, tw, ONE, tw)):
        pytest.skip("this torch has no CPU kernel for F.scaled_mm (torch 2.11)")
    with fp8.checked_fp8():
        assert F.scaled_mm(a, b, ONE, tw, ONE, tw).shape == (16, 64)
        with pytest.raises(Fp8ScaleError, match="F.scaled_mm, operand scale_b"):
            F.scaled_mm(a, b, ONE, tw, torch.tensor(float("nan")), tw)
        bad = a.clone()
        bad.view(torch.uint8)[0, 0] = 0xFF
        with pytest.raises(Fp8NonFiniteError, match="torch._scaled_grouped_mm, operand mat_a"):
            torch._scaled_grouped_mm(
                bad, b.t().reshape(2, 32, 32).transpose(-2, -1), torch.ones(16), torch.ones(2, 32),
                offs=torch.tensor([8, 16], dtype=torch.int32), out_dtype=torch.bfloat16,
            )  # fmt: skip


def test_operand_not_float8() -> None:
    with (
        fp8.checked_fp8(),
        pytest.raises(Fp8ArgumentError, match=r"mat_a is torch.float32, not a float8 dtype"),
    ):
        torch._scaled_mm(torch.randn(16, 32), _operands()[1], ONE, ONE)


@pytest.mark.parametrize(
    ("dtype", "hip", "arch", "expected"),
    [
        (torch.float8_e4m3fn, None, (9, 0), None),
        (torch.float8_e4m3fn, None, (8, 0), "need compute capability 8.9 or newer"),
        (torch.float8_e4m3fnuz, None, (9, 0), "float8_e4m3fnuz is ROCm's (MI300) format"),
        (torch.float8_e4m3fn, "6.4", "gfx942:sramecc+:xnack-", "(MI300) runs float8_e4m3fnuz"),
        (torch.float8_e5m2fnuz, "6.4", "gfx950", "is the MI300 (gfx94x) format"),
    ],
)
def test_float8_dtypes_the_device_lacks(dtype, hip, arch, expected) -> None:
    text = direct.device_lacks(dtype, "cuda", hip, arch)
    assert (text is None) if expected is None else (expected in text)
    assert direct.device_lacks(dtype, "cpu", None, None) is None


def test_outside_the_block_nothing_is_patched() -> None:
    original = torch._scaled_mm
    with fp8.checked_fp8():
        with fp8.checked_fp8():
            assert torch._scaled_mm is not original
        assert torch._scaled_mm is not original
    assert torch._scaled_mm is original and not hasattr(torch.Tensor.to, "__wrapped__")


@pytest.mark.slow
def test_capsule_of_a_zero_scale_replays_the_scaled_gemm_alone(tmp_path, monkeypatch) -> None:
    import cublas_guard_ext as cge

    monkeypatch.setenv("CUBLAS_GUARD_CAPSULE_DIR", str(tmp_path))
    a, b = _operands()
    with fp8.checked_fp8(), pytest.raises(Fp8ScaleError) as info:
        torch._scaled_mm(a, b, ONE, torch.tensor(0.0), out_dtype=torch.bfloat16)
    path = info.value.capsule
    assert path is not None and path in str(info.value)
    data = cge.capsule.load(path)
    assert data["scaled_gemm"]["op"] == "torch._scaled_mm" and data["scaled_gemm"]["values_kept"]
    result = cge.replay(path)
    assert result["reproduced"], result["verdict"]
    assert (
        "torch._scaled_mm alone on cpu: 0 NaN and 0 Inf of 1024 output values, 1024 zeros"
        in result["verdict"]
    )
    assert "amax of Inf" in result["verdict"]  # the error's own advice, carried along


@pytest.mark.slow
def test_capsule_of_a_nan_code_in_f_scaled_mm_replays(tmp_path, monkeypatch) -> None:
    import cublas_guard_ext as cge

    if not hasattr(F, "scaled_mm"):
        pytest.skip("this torch has no F.scaled_mm")
    monkeypatch.setenv("CUBLAS_GUARD_CAPSULE_DIR", str(tmp_path))
    a, b = _operands()
    tw = F.ScalingType.TensorWise
    if not _runs(lambda: F.scaled_mm(a, b, ONE, tw, ONE, tw)):  # the replay runs it
        pytest.skip("this torch has no CPU kernel for F.scaled_mm (torch 2.11)")
    a = a.clone()
    a.view(torch.uint8)[0, 0] = 0x7F
    with fp8.checked_fp8(), pytest.raises(Fp8NonFiniteError) as info:
        F.scaled_mm(a, b, ONE, tw, ONE, tw)
    result = cge.replay(info.value.capsule)
    assert result["reproduced"] and "F.scaled_mm alone on cpu: 64 NaN and 0 Inf of 1024" in result["verdict"]
