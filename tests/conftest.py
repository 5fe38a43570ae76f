"""Shared fixtures: devices, TF32 off, per-test seeds, the test hooks, tolerance helpers."""

from __future__ import annotations

import os
import tempfile
import zlib

import pytest
import torch

# The native test hooks (fault injection, the lowered size limit) refuse to act
# without this; set before anything calls them.
os.environ.setdefault("CUBLAS_GUARD_EXT_TESTING", "1")
# Failure capsules of the tests' injected faults go to a folder of the test session, not
# into the user's cache (tests/test_capsule.py points each of its tests at its own).
os.environ.setdefault("CUBLAS_GUARD_CAPSULE_DIR", tempfile.mkdtemp(prefix="cublas_guard_capsules-"))

import cublas_guard_ext  # noqa: E402  (after the env var, before the tests import it)

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


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def seed_for(nodeid: str) -> int:
    """The torch seed of one test: a CRC32 of its id ("tests/test_x.py::test_y[cpu]"), the same
    in every process and on every machine (hash() of a str is salted per process), so a failure
    seen once replays by running that test again."""
    return zlib.crc32(nodeid.encode()) % (2**31)


@pytest.fixture(autouse=True)
def _no_tf32_and_fresh_seed(request: pytest.FixtureRequest):
    """TF32 off (exact float32 GEMMs), and a per-test seed that differs per test (seed_for)."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(seed_for(request.node.nodeid))
    yield
    torch.backends.cuda.matmul.allow_tf32 = old[0]
    torch.set_float32_matmul_precision(old[1])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing test's report names its seed: a "test seed" section under the failure and a
    `seed` property in --junitxml output."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        seed = seed_for(item.nodeid)
        report.sections.append(
            (
                "test seed",
                f"seed={seed} (torch.manual_seed of CRC32({item.nodeid!r}); "
                "the same on every run of this test)",
            )
        )
        # junitxml writes the properties of the teardown report, a copy of item.user_properties.
        for props in (item.user_properties, report.user_properties):
            if ("seed", seed) not in props:
                props.append(("seed", seed))


@pytest.fixture(autouse=True)
def _no_leftover_async_record():
    """An async finding one test leaves behind must not fail the next test."""
    yield
    try:
        cublas_guard_ext.check()
    except cublas_guard_ext.NonFiniteInputError:
        pass


@pytest.fixture
def size_limit():
    """Lower cuBLAS's 32-bit limit for one test; restore it afterwards."""
    previous: list[int] = []

    def set_limit(limit: int, allow_64bit: bool = True) -> None:
        previous.append(torch.ops.cublas_guard_testing.set_size_limit(limit, allow_64bit))

    yield set_limit
    if previous:
        torch.ops.cublas_guard_testing.set_size_limit(previous[0], True)


@pytest.fixture
def inject_fault():
    """Make the native wrapper see a fault at a site ('gemm', 'launch', 'handle')."""
    armed: list[str] = []

    def arm(site: str, code: int, times: int = 1) -> None:
        armed.append(site)
        torch.ops.cublas_guard_testing.set_fault(site, code, times)

    yield arm
    for site in armed:
        torch.ops.cublas_guard_testing.set_fault(site, 0, 0)


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
