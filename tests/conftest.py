"""Shared fixtures: devices, TF32 off, per-test seeds, the test hooks. The shared functions and
constants (assert_matches, requires_cuda, ...) are in tests/helpers/."""

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
# into the user's cache (tests/forensics/test_capsule.py points each of its tests at its own).
# One folder per pytest-xdist worker: the workers inherit the controller's environment, and
# the capsule folder keeps only the newest capsules, so a worker injecting thousands of faults
# would delete the capsule another worker's test is about to replay.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER or "CUBLAS_GUARD_CAPSULE_DIR" not in os.environ:
    os.environ["CUBLAS_GUARD_CAPSULE_DIR"] = tempfile.mkdtemp(
        prefix=f"cublas_guard_capsules-{_WORKER or 'main'}-"
    )

# pytest-xdist: each of N workers would start torch's intra-op pool at one thread per core, N
# times as many threads as cores, and an idle OpenMP thread spin-waits on a core another worker
# needs. Each worker gets its share of the cores instead (OMP_NUM_THREADS, when set, decides).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

import cublas_guard_ext  # noqa: E402  (after the env var, before the tests import it)
from cublas_guard_ext._native.loading import loader as _loader  # noqa: E402

# .ci/cuda_build_check.sh tests the installed wheel from a copy of the tree: every process of
# the session, each pytest-xdist worker included, must have imported the package from there.
_EXPECTED_PACKAGE = os.environ.get("CUBLAS_GUARD_EXT_TESTS_EXPECT_PACKAGE")
if _EXPECTED_PACKAGE and os.path.realpath(cublas_guard_ext.__file__) != os.path.realpath(_EXPECTED_PACKAGE):
    raise pytest.UsageError(
        f"the tests imported cublas_guard_ext from {cublas_guard_ext.__file__}, not from "
        f"{_EXPECTED_PACKAGE} (CUBLAS_GUARD_EXT_TESTS_EXPECT_PACKAGE)"
    )

from helpers import DEVICES  # noqa: E402  (helpers imports the extension too)

# The stable core alone (CUBLAS_GUARD_EXT_NATIVE=core, or a torch the wheel's _C is not for):
# tests marked `locked` need the version-locked library (watch, the fast eager entry, the
# parameter cache) and are skipped; the test hooks, called directly, raise their errors typed
# as under the locked library (the package's own entry points do that themselves).
CORE_ALONE = _loader.info().library == "core"
# tests/watch/ is all watch, whose test hooks do not even exist then: not collected.
collect_ignore = ["watch"] if CORE_ALONE else []
if CORE_ALONE:
    from helpers.core import translate_test_hooks

    translate_test_hooks()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not CORE_ALONE:
        return
    skip = pytest.mark.skip(reason="needs the version-locked library (the stable core alone is loaded)")
    for item in items:
        if "locked" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def seed_for(nodeid: str) -> int:
    """The torch seed of one test: a CRC32 of its id ("tests/linear/test_x.py::test_y[cpu]"), the same
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
