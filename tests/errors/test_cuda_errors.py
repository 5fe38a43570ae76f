"""Which CUDA errors a guarded call reports as an earlier kernel's, and which it clears.

The decisions live in csrc/pending_errors.cpp and are the ones csrc/cuda/linear.cu runs. On any
machine they run here against a model of the CUDA runtime's last-error rules (the test op
``cublas_guard_testing.simulate_cuda_errors``: cudaGetLastError resets all but a sticky error, cudaStreamQuery on a
busy stream leaves cudaErrorNotReady behind, a query of a capturing stream invalidates the
capture). The CUDA test at the end provokes the real stray error; it skips without a GPU.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers import assert_matches, requires_cuda

# cudaError_t values, written out from driver_types.h (not taken from the product).
INVALID_VALUE, MEMORY_ALLOCATION, NO_KERNEL_IMAGE = 1, 2, 209
NOT_READY, CAPTURE_UNSUPPORTED = 600, 900
INVALID_DEVICE = 101  # cudaErrorInvalidDevice
STICKY = {
    214: "ECCUncorrectable",
    700: "IllegalAddress",
    702: "LaunchTimeout",
    710: "Assert",
    714: "HardwareStackError",
    715: "IllegalInstruction",
    716: "MisalignedAddress",
    717: "InvalidAddressSpace",
    718: "InvalidPc",
    719: "LaunchFailure",
}
NOT_STICKY = [INVALID_VALUE, MEMORY_ALLOCATION, NO_KERNEL_IMAGE, NOT_READY, CAPTURE_UNSUPPORTED]


def simulate(
    stage: str, last: int = 0, context: int = 0, busy: bool = False, capturing: bool = False
) -> dict[str, int]:
    result = torch.ops.cublas_guard_testing.simulate_cuda_errors(stage, last, context, busy, capturing)
    return dict(zip(("reported", "left", "queries", "capture_invalidated", "next_call"), result))


def test_a_torch_failure_on_a_busy_stream_leaves_no_error_for_the_next_call() -> None:
    """The defect: the query's cudaErrorNotReady stayed the thread's last error, and every later
    sync-mode call reported it as "left by an earlier CUDA kernel"."""
    assert simulate("failure", busy=True) == {
        "reported": 0,
        "left": 0,
        "queries": 1,
        "capture_invalidated": 0,
        "next_call": 0,
    }


@pytest.mark.parametrize("code", NOT_STICKY)
def test_a_stray_non_sticky_error_is_cleared_not_reported(code: int) -> None:
    before = simulate("before", last=code)
    assert (before["reported"], before["left"], before["next_call"]) == (0, 0, 0)
    failure = simulate("failure", last=code, busy=True)
    assert (failure["reported"], failure["left"], failure["next_call"]) == (0, 0, 0)


@pytest.mark.parametrize("code", sorted(STICKY), ids=[STICKY[c] for c in sorted(STICKY)])
def test_a_sticky_error_is_reported_before_and_after_a_failure(code: int) -> None:
    assert simulate("before", context=code)["reported"] == code
    assert simulate("failure", context=code, busy=True)["reported"] == code
    # A sticky error behind a clean last error surfaces at the stream query.
    after_query = simulate("failure", context=code)
    assert after_query["reported"] == code and after_query["next_call"] == code


def test_a_stream_being_captured_is_never_queried() -> None:
    """cudaStreamQuery on a capturing stream would invalidate the user's capture."""
    r = simulate("failure", busy=True, capturing=True)
    assert r == {"reported": 0, "left": 0, "queries": 0, "capture_invalidated": 0, "next_call": 0}


def test_a_clean_state_reports_nothing() -> None:
    assert simulate("before") == {
        "reported": 0,
        "left": 0,
        "queries": 0,
        "capture_invalidated": 0,
        "next_call": 0,
    }
    assert simulate("failure")["reported"] == 0


def test_an_unknown_stage_is_refused() -> None:
    with pytest.raises(ValueError, match="stage must be 'before' or 'failure'"):
        simulate("later")


def _cudart_of_this_process() -> ctypes.CDLL:
    """The libcudart the extension and torch use (its last-error state is per library instance)."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
    if len(paths) != 1:
        pytest.skip(f"expected one shared libcudart in this process, found {sorted(paths)}")
    return ctypes.CDLL(paths.pop())


@requires_cuda
def test_a_stray_not_ready_does_not_fail_later_sync_calls() -> None:
    """The real defect: someone's cudaStreamQuery on a busy stream leaves cudaErrorNotReady as
    the thread's last error; sync-mode calls peeked at it and failed, each of them, forever."""
    layer = cg.SafeLinear(64, 32, device="cuda", mode="sync", name="after_a_query")
    x = torch.randn(8, 64, device="cuda")
    layer(x)
    cudart = _cudart_of_this_process()
    cudart.cudaStreamQuery.argtypes = [ctypes.c_void_p]
    torch.cuda._sleep(100_000_000)  # about 50 ms of work: the stream is busy
    assert cudart.cudaStreamQuery(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)) == NOT_READY
    stray = cudart.cudaPeekAtLastError()
    if stray == 0:
        # The CUDA 13.0 runtime on the H200 machine (2026-11-30) does not record a query's
        # cudaErrorNotReady as the last error. Plant another non-sticky one: a failing call.
        value = ctypes.c_int()
        cudart.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        assert cudart.cudaDeviceGetAttribute(ctypes.byref(value), 1, 10_000) == INVALID_DEVICE
        stray = cudart.cudaPeekAtLastError()
    if stray == 0:
        pytest.skip("this CUDA runtime records neither error as the last error: nothing stray to clear")
    assert stray in (NOT_READY, INVALID_DEVICE)  # the stray error is in place
    for _ in range(3):
        assert_matches(layer(x), F.linear(x, layer.weight, layer.bias))
    assert cudart.cudaPeekAtLastError() == 0
    torch.cuda.synchronize()
