"""What the tests share: the devices this machine tests, the CUDA skip marker, cuBLAS's status
names, tolerance checks and memory measurements. Concern-specific helpers live in this package's
modules (inputs, distributed and its rank_forks, run_scripts, watch_models, doctor_env,
cuda_toolkit); fixtures live in the conftest.py files. Test files import from here, never from each other.

tests/conftest.py sets the environment the native test hooks need and imports the extension
before any test module imports this package."""

from __future__ import annotations

import os

import pytest
import torch

import cublas_guard_ext  # noqa: F401  (registers the ops HAS_CUDA asks about)

HAS_CUDA = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
    "cublas_guard::linear", "CUDA"
)


requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and the CUDA build")


# Every cublasStatus_t failure value, written out independently of the product's own
# table (cublas_api.h), so the tests check the names rather than trust them.
CUBLAS_STATUSES = {
    1: "CUBLAS_STATUS_NOT_INITIALIZED",
    3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE",
    8: "CUBLAS_STATUS_ARCH_MISMATCH",
    11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED",
    14: "CUBLAS_STATUS_INTERNAL_ERROR",
    15: "CUBLAS_STATUS_NOT_SUPPORTED",
    16: "CUBLAS_STATUS_LICENSE_ERROR",
}


DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


# The float32 GEMM routine reports name, per device: (32-bit API, 64-bit API). The CPU runs
# torch's addmm, which has no 32-bit limit (the tests' lowered limit emulates cuBLAS's there).
SGEMM = {"cpu": ("torch CPU addmm", "torch CPU addmm"), "cuda": ("cublasSgemm", "cublasSgemm_64")}


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; psutil is not a dependency)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def allocated(device: str) -> int:
    """torch's allocated GPU bytes after the queue drains (0 on the CPU)."""
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def memory_growth(call, warmup: int, steps: int, device: str) -> tuple[int, int, int, int]:
    """Run call(i) warmup times, then steps times; (rss0, rss1, gpu0, gpu1) around the latter."""
    import gc

    for i in range(warmup):
        call(i)
    gc.collect()
    rss0, gpu0 = rss_bytes(), allocated(device)
    for i in range(warmup, warmup + steps):
        call(i)
    gc.collect()
    return rss0, rss_bytes(), gpu0, allocated(device)


def max_rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e|: relative to the tensor's scale, not per element."""
    expected64 = expected.detach().double()
    scale = expected64.abs().max().item() if expected64.numel() else 0.0
    if scale == 0.0:
        scale = 1.0
    return (actual.detach().double() - expected64).abs().max().item() / scale if expected64.numel() else 0.0


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    err = max_rel_error(actual, expected)
    assert err <= rel, f"max relative error {err:.3g} > {rel:.3g}"


def gemm_spans(fields: dict) -> dict[str, int]:
    """Elements each operand of a reported cuBLAS call spans, from a CublasError's fields: an
    operand stored column-major as [inner x outer] with leading dimension ld spans
    (outer - 1) * ld + inner elements."""
    m, n, k = fields["m"], fields["n"], fields["k"]
    a_inner, a_outer = (k, m) if fields["transa"] == "T" else (m, k)
    b_inner, b_outer = (n, k) if fields["transb"] == "T" else (k, n)
    return {
        "a": (a_outer - 1) * fields["lda"] + a_inner,
        "b": (b_outer - 1) * fields["ldb"] + b_inner,
        "c": (n - 1) * fields["ldc"] + m,
    }
