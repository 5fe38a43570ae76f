"""watch: a cuBLAS or CUDA error inside any op is re-raised typed, with its module and op."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import cublas_guard_ext as cg

from helpers.watch_models import nothing_left

# -- cuBLAS / CUDA errors re-raised ----------------------------------------------------

_FAILURE = {"message": ""}


@torch.library.custom_op("watchtest::failing_gemm", mutates_args=())
def failing_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _FAILURE["message"]:
        raise RuntimeError(_FAILURE["message"])
    return a @ b


class GemmLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return failing_gemm(x, self.w)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = GemmLayer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(x))


@pytest.fixture
def failure():
    def set_message(message: str) -> None:
        _FAILURE["message"] = message

    yield set_message
    _FAILURE["message"] = ""


def test_cublas_error_from_any_op_is_reraised_typed_with_module_and_op(failure):
    message = (
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, "
        "m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc)`"
    )
    failure(message)
    model = Outer()
    with pytest.raises(cg.CublasError) as info:
        with cg.watch(model, mode="sync"):
            model(torch.randn(4, 6))
    err = info.value
    assert not isinstance(err, cg.CublasOutOfMemoryError)
    assert err.status == 13 and err.status_name == "CUBLAS_STATUS_EXECUTION_FAILED"
    assert err.op == "watchtest.failing_gemm.default" and err.module == "proj"
    assert err.input_names == ["a", "b"] and err.input_shapes == [[4, 6], [6, 3]]
    assert err.input_strides == [[6, 1], [3, 1]]
    assert isinstance(err.__cause__, RuntimeError) and str(err.__cause__) == message
    text = str(err)
    assert "watch: watchtest.failing_gemm.default in module 'proj'" in text
    assert "an EARLIER asynchronous CUDA error" in text  # the same diagnosis SafeLinear gives
    nothing_left()


def test_cublas_alloc_failed_is_reraised_as_out_of_memory(failure):
    failure("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    model = Outer()
    with pytest.raises(cg.CublasOutOfMemoryError) as info:
        with cg.watch(model, mode="async"):
            model(torch.randn(4, 6))
    assert isinstance(info.value, torch.OutOfMemoryError) and info.value.status == 3


def test_cuda_error_is_reraised_as_pending_cuda_error(failure):
    model = Outer()
    x = torch.randn(4, 6, requires_grad=True)
    failure("CUDA error: device-side assert triggered")
    with pytest.raises(cg.PendingCudaError) as info:
        with cg.watch(model, mode="sync"):
            model(x)
    assert info.value.cuda_error_string == "device-side assert triggered"
    assert info.value.module == "proj"


def test_other_errors_pass_through_unchanged(failure):
    failure("something else went wrong")
    model = Outer()
    with pytest.raises(RuntimeError, match="something else went wrong") as info:
        with cg.watch(model, mode="sync"):
            model(torch.randn(4, 6))
    assert not isinstance(info.value, cg.GuardError)
    nothing_left()
