"""What is compiled: the extension's sources, relative to csrc/ (build.py re-exports them;
setup.py and the JIT build share them).

The core's sources (``CORE_*``) are compiled into both native libraries: the stable core
``_core`` (LibTorch's stable ABI, one binary for every torch from its floor on) and the
version-locked ``_C`` (ATen, for one torch), which adds ``LOCKED_*`` (csrc/core/tensor_api.h
says why). ``CPU_SOURCES``/``CUDA_SOURCES`` are the locked library's whole list.

A file's library is its folder: the ``LOCKED_*`` sources are exactly those under csrc/locked/,
and no core source includes a header from there (tests/building/test_source_layout.py).
"""

# By concern (csrc/README.md). Every base name is unique: torch's JIT builder names each
# object file after its source's base name alone.
CORE_CPU_SOURCES = (
    "ops.cpp",
    "testing.cpp",
    "core/tensor_api_aten.cpp",
    "core/tensor_api_stable.cpp",
    "linear/checks.cpp",
    "linear/linear_common.cpp",
    "linear/value_scans.cpp",
    "linear/gemm_plan.cpp",
    "linear/param_cache.cpp",
    "linear/param_cache_stable.cpp",
    "linear/linear_cpu.cpp",
    "linear/gemm_route.cpp",
    "moe/grouped_checks.cpp",
    "moe/grouped_common.cpp",
    "moe/grouped_cpu.cpp",
    "report/errors.cpp",
    "report/raise_aten.cpp",
    "report/raise_stable.cpp",
    "report/async_registry.cpp",
    "report/pending_errors.cpp",
    "report/call_scope.cpp",
    "linear/gemm_report.cpp",
    "replay/replay_cpu.cpp",
    "scan/scan_cpu.cpp",
    "python_entry_stable.cpp",
)
LOCKED_CPU_SOURCES = (
    "locked/ops_meta.cpp",
    "locked/moe/grouped_autograd.cpp",
    "locked/python_module.cpp",
    "locked/linear/autograd.cpp",
    "locked/linear/autocast.cpp",
    "locked/report/python_errors.cpp",
    "locked/watch/watch_ops.cpp",
    "locked/watch/watch_session.cpp",
    "locked/watch/watch_verify.cpp",
    "locked/watch/watch_fallback.cpp",
    "locked/watch/watch_reraise.cpp",
    "locked/watch/watch_python.cpp",
    "locked/watch/watch_device.cpp",
    "locked/watch/watch_slots.cpp",
    "locked/watch/watch_device_report.cpp",
    "locked/watch/watch_device_cpu.cpp",
    "locked/watch/watch_views.cpp",
    "locked/watch/watch_testing.cpp",
)
CORE_CUDA_SOURCES = (
    "core/cuda_api_aten.cpp",
    "core/cuda_api_stable.cpp",
    "core/core_cuda_module.cpp",
    "cuda/scan.cu",
    "cuda/linear.cu",
    "cuda/cublas_gemm.cu",
    "cuda/lt_gemm.cu",
    "cuda/async_slot.cu",
    "replay/replay_cuda.cu",
    "moe/grouped_cuda.cu",
)
LOCKED_CUDA_SOURCES = ("locked/watch/watch_scan.cu",)
# The stable core's module (core_build.py): the empty module whose import registers the ops.
CORE_MODULE_SOURCE = "core/core_module.cpp"

CPU_SOURCES = CORE_CPU_SOURCES + LOCKED_CPU_SOURCES
CUDA_SOURCES = CORE_CUDA_SOURCES + LOCKED_CUDA_SOURCES

# The unity build (unity_build.py): each library compiles its C++ sources of one layer as one
# translation unit, the core's (with the core's CUDA C++ and module files, where the build has
# them) and the locked library's own. A name in no group is compiled alone; .cu files always are.
UNITY_GROUPS = {
    "core": CORE_CPU_SOURCES
    + (CORE_MODULE_SOURCE,)
    + tuple(s for s in CORE_CUDA_SOURCES if s.endswith(".cpp")),
    "locked": LOCKED_CPU_SOURCES,
}
