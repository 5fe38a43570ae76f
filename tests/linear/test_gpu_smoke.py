"""The GPU run's first answers (benchmarks/gpu/gpu_check.sh's smoke step): half and double
precision forward and backward against F.linear on both GEMM paths, and the scan of more than
2^31 elements, contiguous and strided. They skip without a GPU. (The smoke step also runs
test_libstdcxx.py, the 64-bit routines of test_dtypes.py and one watch producer test on CUDA.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers import HAS_CUDA, assert_matches

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and the CUDA build")

TOL = {torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.fixture
def gemm_path():
    previous: list[str] = []

    def use(path: str) -> None:
        previous.append(torch.ops.cublas_guard_testing.set_gemm_path(path))

    yield use
    if previous:
        torch.ops.cublas_guard_testing.set_gemm_path(previous[0])


@pytest.mark.parametrize("path", ["legacy", "lt"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_cuda_half_and_double_forward_backward_match_f_linear(gemm_path, path: str, dtype) -> None:
    gemm_path(path)
    layer = cg.SafeLinear(96, 40, device="cuda", dtype=dtype, mode="async", name=f"smoke_{path}")
    x = torch.randn(4, 24, 96, device="cuda", dtype=dtype, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_(True)
    y, ref = layer(x), F.linear(ref_x, layer.weight, layer.bias)
    assert_matches(y, ref, rel=TOL[dtype])
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, layer.weight, layer.bias], g)
    want = torch.autograd.grad(ref, [ref_x, layer.weight, layer.bias], g)
    for a, b in zip(got, want):
        assert_matches(a, b, rel=TOL[dtype])
    cg.check()


BIG = 2**31 + 10  # logical elements: int64 indexing in the kernel and the record


def _need(bytes_needed: int) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < bytes_needed + (2 << 30):
        pytest.skip(f"needs {bytes_needed / 2**30:.1f} GiB of free GPU memory")


def test_cuda_scan_beyond_2_31_elements_contiguous() -> None:
    _need(BIG * 2)
    x = torch.zeros(BIG, device="cuda", dtype=torch.float16)
    assert cg.scan(x).first_bad_index == -1
    x[BIG - 3] = float("nan")
    x[2**31 + 1] = float("inf")
    r = cg.scan(x)
    assert (r.nan_count, r.posinf_count, r.neginf_count, r.first_bad_index) == (1, 1, 0, 2**31 + 1)
    del x
    torch.cuda.empty_cache()


def test_cuda_scan_beyond_2_31_elements_strided() -> None:
    _need(BIG * 2 * 2)
    storage = torch.zeros(BIG, 2, device="cuda", dtype=torch.float16)
    view = storage[:, 1]  # BIG elements, stride 2: the strided kernel
    assert not view.is_contiguous() and view.numel() == BIG
    storage[:, 0] = float("nan")  # outside the view: never counted
    assert cg.scan(view).first_bad_index == -1
    view[2**31 + 7] = float("-inf")
    view[BIG - 1] = float("nan")
    r = cg.scan(view)
    assert (r.nan_count, r.posinf_count, r.neginf_count, r.first_bad_index) == (1, 0, 1, 2**31 + 7)
    del storage, view
    torch.cuda.empty_cache()
