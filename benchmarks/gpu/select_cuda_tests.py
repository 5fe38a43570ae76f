"""pytest plugin for the GPU check (benchmarks/gpu/gpu_check.sh): which CUDA tests each step runs.

Load it with ``PYTHONPATH=benchmarks/gpu pytest -p select_cuda_tests --gpu-step STEP``. Every test
of the suite lands in at most one step, so no test runs twice in the two runs:

  smoke   run 1's first answers: the items under SMOKE (node-id prefixes), except their CPU
          parametrizations (a ``device``-like parameter that is "cpu");
  tests   run 1's xdist run: every other CUDA test, except watch's;
  watch   run 2: watch's CUDA tests (every file under ``tests/watch/``, whatever its name:
          the watch workstream adds and renames them).

A CUDA test is one that skips without a GPU -- it carries a ``skipif`` marker (on the test, its
class or its module's ``pytestmark``) whose reason names CUDA or a GPU, as the suite's
``requires_cuda`` does -- or one parametrized on the CUDA device (a parameter whose value is
"cuda", "cuda:N" or a CUDA ``torch.device``, as the ``device`` fixture's ``[cuda]`` cases), or one
marked ``@pytest.mark.cuda``. Never by the substring "cuda" in a name: CPU-only tooling tests
(the CUDA build check, the doctor) have it too.
"""

from __future__ import annotations

import re

STEPS = ("smoke", "tests", "watch")

# Node-id prefixes of the smoke step (about 30 s on an H200 with pytest's start): the shared C++
# runtime in a fresh process, half and double precision forward and backward on both GEMM paths,
# every dtype's _64 routine through the lowered size limit, one watch producer test on CUDA.
SMOKE = (
    "tests/building/test_libstdcxx.py",
    "tests/linear/test_gpu_smoke.py::test_cuda_half_and_double_forward_backward_match_f_linear",
    "tests/linear/test_dtypes.py::test_split_and_64bit_per_dtype",
    "tests/watch/test_watch.py::test_per_device_forward_producer_named_by_module_and_op",
)
WATCH_FILES = re.compile(r"^tests/watch/[^/]*\.py::")
_REASON = re.compile(r"\b(CUDA|GPU)\b", re.I)


def _is_cuda_value(value: object) -> bool:
    text = str(value)
    return text == "cuda" or text.startswith("cuda:") or getattr(value, "type", None) == "cuda"


def _is_cpu_value(value: object) -> bool:
    return str(value) == "cpu" or getattr(value, "type", None) == "cpu"


def is_cuda_test(item) -> bool:
    if item.get_closest_marker("cuda") is not None:
        return True
    for mark in item.iter_markers(name="skipif"):
        if _REASON.search(str(mark.kwargs.get("reason", ""))):
            return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(_is_cuda_value(v) for v in callspec.params.values())


def _is_cpu_case(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(_is_cpu_value(v) for v in callspec.params.values())


def step_of(nodeid: str, cuda: bool, cpu_case: bool) -> str | None:
    """The step that runs a test (None: no GPU step). `cuda`: is_cuda_test; `cpu_case`: one of
    its parameters is the CPU device."""
    if nodeid.startswith(SMOKE):
        return None if cpu_case else "smoke"
    if not cuda:
        return None
    return "watch" if WATCH_FILES.match(nodeid) else "tests"


def item_step(item) -> str | None:
    return step_of(item.nodeid, is_cuda_test(item), _is_cpu_case(item))


def pytest_addoption(parser) -> None:
    parser.addoption("--gpu-step", choices=STEPS, help="the GPU check's step whose tests to keep")


def pytest_collection_modifyitems(config, items) -> None:
    step = config.getoption("--gpu-step")
    if step is None:
        raise SystemExit("select_cuda_tests: pass --gpu-step smoke|tests|watch")
    keep = [item for item in items if item_step(item) == step]
    dropped = [item for item in items if item_step(item) != step]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


if __name__ == "__main__":  # the files the smoke step collects (gpu_check.sh), one line
    print(" ".join(sorted({prefix.split("::")[0] for prefix in SMOKE})))
