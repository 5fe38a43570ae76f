"""Every bad input gets its exact exception type and a message naming the layer,
the shape and the expected value; the input is unchanged; the layer still works."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext import errors

from helpers import CUBLAS_STATUSES as STATUSES
from helpers import HAS_CUDA, SGEMM, assert_matches

NAN, INF = float("nan"), float("inf")


def layer(device: str, in_features: int = 8, out_features: int = 4) -> cg.SafeLinear:
    return cg.SafeLinear(in_features, out_features, device=device, name="encoder.0.fc1")


def still_works(safe: cg.SafeLinear) -> None:
    x = torch.randn(3, safe.in_features, device=safe.weight.device)
    assert_matches(safe(x), nn.functional.linear(x, safe.weight, safe.bias))


def test_nan_input_names_counts_index_and_coords(device: str) -> None:
    safe = layer(device)
    x = torch.randn(2, 5, 8, device=device)
    x[1, 3, 6] = NAN
    x[1, 4, 0] = INF
    x[0, 2, 1] = -INF  # the first in logical order
    before = x.clone()
    with pytest.raises(cg.NonFiniteInputError) as info:
        safe(x)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, cg.GuardError)
    assert (err.nan_count, err.posinf_count, err.neginf_count) == (1, 1, 1)
    assert err.first_bad_index == 0 * 40 + 2 * 8 + 1
    assert err.first_bad_coords == [0, 2, 1]
    assert err.layer == "encoder.0.fc1" and err.role == "input" and err.shape == [2, 5, 8]
    text = str(err)
    assert "'encoder.0.fc1'" in text
    assert "1 NaN, 1 +Inf, 1 -Inf" in text
    assert "flat index 17 = x[0, 2, 1] (-Inf)" in text
    assert "shape [2, 5, 8]" in text
    assert "do not make cuBLAS fail" in text, "the message must not blame cuBLAS for NaN"
    assert torch.equal(x.nan_to_num(), before.nan_to_num()) and torch.equal(x.isnan(), before.isnan())
    still_works(safe)


@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_single_bad_value_positions(device: str, position: str, value: float) -> None:
    safe = layer(device)
    x = torch.randn(6, 8, device=device)
    index = {"first": 0, "middle": 23, "last": 47}[position]
    x.view(-1)[index] = value
    with pytest.raises(cg.NonFiniteInputError) as info:
        safe(x)
    assert info.value.first_bad_index == index
    assert info.value.first_bad_coords == [index // 8, index % 8]
    expected = {"nan": (1, 0, 0), "inf": (0, 1, 0), "-inf": (0, 0, 1)}[str(value)]
    assert (info.value.nan_count, info.value.posinf_count, info.value.neginf_count) == expected


@pytest.mark.parametrize("param", ["weight", "bias"])
def test_non_finite_parameters(device: str, param: str) -> None:
    safe = layer(device)
    still_works(safe)  # scanned clean once: cached by version counter
    with torch.no_grad():
        getattr(safe, param).view(-1)[2] = INF  # bumps the version: scanned again
    with pytest.raises(cg.NonFiniteInputError) as info:
        safe(torch.randn(3, 8, device=device))
    assert info.value.role == param
    assert f"{param} has 0 NaN, 1 +Inf, 0 -Inf" in str(info.value)
    assert "learning rate" in str(info.value), "parameter divergence gets its own advice"
    with torch.no_grad():
        getattr(safe, param).view(-1)[2] = 0.5
    still_works(safe)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
)
def test_wrong_input_dtype(device: str, dtype: torch.dtype) -> None:
    safe = layer(device)
    x = torch.ones(3, 8, device=device, dtype=dtype)
    with pytest.raises(cg.DTypeError) as info:
        safe(x)
    err = info.value
    assert isinstance(err, TypeError) and isinstance(err, RuntimeError)
    assert err.role == "input" and err.layer == "encoder.0.fc1"
    if dtype.is_floating_point:  # a floating dtype other than the layer's: nn.Linear's mismatch
        assert err.reason == "mismatch" and "x = x.to(torch.float32)" in str(err)
    else:
        assert err.reason == "unsupported" and "x.float()" in str(err)
    assert "float32-only" not in str(err)
    assert str(dtype) in str(err), "dtypes are named the way torch users write them"
    still_works(safe)


def test_dtype_message_names_the_routines_of_the_device(device: str) -> None:
    expected = "cublasGemmEx" if device == "cuda" else "torch's CPU addmm"
    with pytest.raises(cg.DTypeError, match=re.escape(expected)):
        layer(device)(torch.ones(2, 8, device=device, dtype=torch.int32))


def test_half_precision_layer(device: str) -> None:
    safe = layer(device).half()
    assert safe(torch.randn(2, 8, device=device).half()).dtype == torch.float16
    with pytest.raises(cg.DTypeError) as info:
        safe(torch.randn(2, 8, device=device))
    assert info.value.role == "input" and info.value.other_dtype == "torch.float16"
    assert "layer.to(torch.float32)" in str(info.value)


@pytest.mark.parametrize("shape", [(3, 7), (3, 9), (8, 3), (2, 4, 16), (7,)])
def test_wrong_last_dim(device: str, shape: tuple[int, ...]) -> None:
    safe = layer(device)
    x = torch.randn(shape, device=device)
    with pytest.raises(cg.ShapeMismatchError) as info:
        safe(x)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, RuntimeError)
    assert err.shape == list(shape) and err.expected == 8 and err.layer == "encoder.0.fc1"
    text = str(err)
    assert f"input shape {list(shape)}" in text
    assert "expected in_features = 8" in text and "'encoder.0.fc1'" in text
    still_works(safe)


def test_zero_dim_input(device: str) -> None:
    with pytest.raises(cg.ShapeMismatchError, match="input is 0-d; expected \\[..., 8\\]"):
        layer(device)(torch.tensor(1.0, device=device))


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("direction", ["cpu_input_cuda_layer", "cuda_input_cpu_layer"])
def test_device_mismatch(direction: str) -> None:
    layer_device, input_device = ("cuda", "cpu") if direction == "cpu_input_cuda_layer" else ("cpu", "cuda")
    safe = layer(layer_device)
    with pytest.raises(cg.DeviceMismatchError) as info:
        safe(torch.randn(3, 8, device=input_device))
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.input_device.startswith(input_device) and err.weight_device.startswith(layer_device)
    assert "x = x.to(" in str(err)
    still_works(safe)


def test_meta_device_mismatch_is_typed() -> None:
    """Without a GPU, a meta-device weight shows the same check (no crash, typed error)."""
    safe = cg.SafeLinear(8, 4, device="meta", name="m")
    with pytest.raises(cg.DeviceMismatchError, match="layer 'm': its weight is on the meta device"):
        cg.linear(torch.randn(2, 8), safe.weight, safe.bias, layer="m")


def test_beyond_the_limit_without_a_64bit_api(device: str, size_limit) -> None:
    """What a cuBLAS older than 12 (no cublasSgemm_64) gets: a clear refusal."""
    safe = layer(device, in_features=4, out_features=8)
    size_limit(6, allow_64bit=False)  # pretend cuBLAS's int were 6 and there were no _64 API
    with pytest.raises(cg.SizeLimitError) as info:
        safe(torch.randn(2, 4, device=device))  # m = out_features = ldc = 8: cannot be split
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.argument, err.value, err.limit) == ("m", 8, 6)
    assert f"{SGEMM[device][0]} argument m = 8 exceeds cuBLAS's 32-bit limit 6" in str(err)
    assert "m=8 n=2 k=4 lda=4 ldb=4 ldc=8" in str(err)


def test_in_features_beyond_the_limit_without_a_64bit_api(device: str, size_limit) -> None:
    """Forward: k is split, and the operands whose row stride (in_features) is beyond
    the limit are copied into the layout whose leading dimension fits. Backward: both
    gradient GEMMs have m = in_features, which only the 64-bit API can take."""
    safe = layer(device, in_features=8, out_features=3)
    size_limit(6, allow_64bit=False)
    x = torch.randn(2, 8, device=device, requires_grad=True)
    y = safe(x)
    assert_matches(y, torch.nn.functional.linear(x, safe.weight, safe.bias))
    with pytest.raises(cg.SizeLimitError, match="argument m = 8"):
        y.sum().backward()


def test_invalid_mode_values() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        cg.SafeLinear(4, 2, mode="fast")
    with pytest.raises(ValueError, match="mode must be"):
        torch.ops.cublas_guard.linear(torch.randn(2, 4), torch.randn(2, 4), None, "x", 7)


def test_non_tensor_input() -> None:
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        cg.SafeLinear(4, 2)([1.0, 2.0, 3.0, 4.0])  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# cuBLAS statuses through the fault-injection hook (the same code path on CPU)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("status", list(STATUSES))
def test_every_cublas_status_message(device: str, inject_fault, status: int) -> None:
    safe = layer(device)
    x = torch.randn(5, 8, device=device)
    inject_fault("gemm", status)
    with pytest.raises(cg.CublasError) as info:
        safe(x)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.status == status and err.status_name == STATUSES[status]
    text = str(err)
    assert STATUSES[status] in text and err.meaning in text
    # the call's arguments: y^T = W^T(op T) * x^T, m = out, n = batch, k = in
    assert "transa=T transb=N m=4 n=5 k=8 lda=8 ldb=8 ldc=4" in text
    assert "math mode:" in text and "'encoder.0.fc1'" in text
    assert "operand A (weight^T): shape [8, 4]" in text and "-byte aligned" in text
    assert "operand B (input): shape [5, 8]" in text
    assert "Next: " in text
    still_works(safe)  # the fault was one-shot: the layer recovers


def test_execution_failed_puts_earlier_errors_first(device: str, inject_fault) -> None:
    inject_fault("gemm", 13)
    with pytest.raises(cg.CublasError) as info:
        layer(device)(torch.randn(2, 8, device=device))
    text = str(info.value)
    causes = text.index("likely causes")
    assert text.index("EARLIER asynchronous CUDA error") > causes
    assert "CUDA_LAUNCH_BLOCKING=1" in text
    assert "NaN" not in text.split("Next:")[0].split("likely causes")[1], "NaN is not a cause"


def test_backward_faults_name_the_purpose(device: str, inject_fault) -> None:
    safe = layer(device)
    x = torch.randn(5, 8, device=device, requires_grad=True)
    y = safe(x)
    inject_fault("gemm", 13)
    with pytest.raises(cg.CublasError) as info:
        y.sum().backward()
    assert info.value.purpose in ("grad_input", "grad_weight")
    assert "k=4" in str(info.value)  # the backward GEMMs reduce over out_features or batch


def test_fault_injection_needs_the_testing_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_GUARD_EXT_TESTING")
    with pytest.raises(RuntimeError, match="test hook"):
        torch.ops.cublas_guard_testing.set_fault("gemm", 13, 1)
    with pytest.raises(RuntimeError, match="test hook"):
        torch.ops.cublas_guard_testing.set_size_limit(5)


def test_unknown_fault_site() -> None:
    with pytest.raises(ValueError, match="unknown fault site"):
        torch.ops.cublas_guard_testing.set_fault("nowhere", 1, 1)


# --------------------------------------------------------------------------
# The exception classes themselves
# --------------------------------------------------------------------------
def test_errors_pickle_with_their_fields(device: str) -> None:
    x = torch.randn(2, 8, device=device)
    x[0, 0] = NAN
    with pytest.raises(cg.NonFiniteInputError) as info:
        layer(device)(x)
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is cg.NonFiniteInputError
    assert copy.fields == info.value.fields and str(copy) == str(info.value)


def test_payload_round_trip() -> None:
    err = errors.from_payload(
        {
            "kind": "shape_mismatch",
            "layer": "a.b",
            "shape": [2, 3],
            "expected_last_dim": 4,
            "reason": "last_dim",
        }
    )
    assert isinstance(err, cg.ShapeMismatchError) and err.layer == "a.b"
    native = RuntimeError(
        "cublas_guard_ext: x\n" + errors.PAYLOAD_MARKER + '{"kind": "cublas", "status": 13}'
    )
    typed = errors.from_native(native)
    assert isinstance(typed, cg.CublasError) and typed.status_name == "CUBLAS_STATUS_EXECUTION_FAILED"
    assert errors.from_native(RuntimeError("some other error")) is None
    with pytest.raises(AttributeError):
        _ = err.no_such_field


def test_class_hierarchy() -> None:
    assert issubclass(cg.OutOfMemoryError, torch.OutOfMemoryError)
    assert issubclass(cg.ExtensionBuildError, ImportError)
    for cls in (cg.CublasError, cg.PendingCudaError, cg.CudaLaunchError, cg.GraphCaptureError):
        assert issubclass(cls, RuntimeError) and issubclass(cls, cg.GuardError)
    for cls in (cg.NonFiniteInputError, cg.SizeLimitError, cg.ShapeMismatchError):
        assert issubclass(cls, ValueError)


def test_errors_name_the_rank_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    x = torch.randn(2, 8)
    x[0, 1] = NAN
    with pytest.raises(cg.NonFiniteInputError) as info:
        layer("cpu")(x)
    assert info.value.rank == 1 and info.value.world_size == 4
    assert str(info.value).startswith("[rank 1/4] layer 'encoder.0.fc1'")
    monkeypatch.setenv("WORLD_SIZE", "1")  # a single process: no prefix
    with pytest.raises(cg.NonFiniteInputError) as info:
        layer("cpu")(x)
    assert not str(info.value).startswith("[rank")
