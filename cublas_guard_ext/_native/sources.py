"""What is compiled: the extension's sources, relative to csrc/ (build.py re-exports them;
setup.py and the JIT build share them)."""

# By concern (csrc/README.md). Every base name is unique: torch's JIT builder names each
# object file after its source's base name alone.
CPU_SOURCES = (
    "ops.cpp",
    "python_module.cpp",
    "testing.cpp",
    "linear/checks.cpp",
    "linear/linear_common.cpp",
    "linear/value_scans.cpp",
    "linear/gemm_plan.cpp",
    "linear/param_cache.cpp",
    "linear/linear_cpu.cpp",
    "linear/autograd.cpp",
    "linear/autocast.cpp",
    "linear/gemm_route.cpp",
    "moe/grouped_checks.cpp",
    "moe/grouped_common.cpp",
    "moe/grouped_cpu.cpp",
    "moe/grouped_autograd.cpp",
    "report/errors.cpp",
    "report/async_registry.cpp",
    "report/python_errors.cpp",
    "report/pending_errors.cpp",
    "report/call_scope.cpp",
    "report/gemm_report.cpp",
    "report/replay_cpu.cpp",
    "scan/scan_cpu.cpp",
    "watch/watch_ops.cpp",
    "watch/watch_session.cpp",
    "watch/watch_verify.cpp",
    "watch/watch_fallback.cpp",
    "watch/watch_reraise.cpp",
    "watch/watch_python.cpp",
    "watch/watch_device.cpp",
    "watch/watch_device_report.cpp",
    "watch/watch_device_cpu.cpp",
)
CUDA_SOURCES = (
    "cuda/scan.cu",
    "cuda/linear.cu",
    "cuda/lt_gemm.cu",
    "cuda/async_slot.cu",
    "report/replay_cuda.cu",
    "moe/grouped_cuda.cu",
    "cuda/watch_scan.cu",
)
