"""pytest plugin for the GPU run (benchmarks/gpu/gpu_check.sh, slot "tests"): keep every CUDA test of
the suite, and only those, in one run.

A CUDA test is one that skips without a GPU (a skipif marker whose reason names CUDA: the
suite's ``requires_cuda`` and the CUDA-only files' ``pytestmark``), or one parametrized on or
named after the CUDA device (``[cuda]``, ``..._cuda_...``). Load it with
``PYTHONPATH=benchmarks/gpu pytest -p select_cuda_tests``.
"""

from __future__ import annotations


def is_cuda_test(item) -> bool:
    for mark in item.iter_markers(name="skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if "CUDA" in reason or "GPU" in reason:
            return True
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(str(v) == "cuda" for v in callspec.params.values()):
        return True
    return "cuda" in item.name.lower()


def pytest_collection_modifyitems(config, items):
    keep = [item for item in items if is_cuda_test(item)]
    dropped = [item for item in items if not is_cuda_test(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
