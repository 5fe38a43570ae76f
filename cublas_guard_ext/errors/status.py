"""The cublasStatus_t table: each status's name, meaning, likely causes (most likely
first) and next steps, as every CublasError message writes them."""

from __future__ import annotations

# cublasStatus_t: name, meaning, likely causes (most likely first), next steps.
CUBLAS_STATUS: dict[int, tuple[str, str, tuple[str, ...], tuple[str, ...]]] = {
    0: ("CUBLAS_STATUS_SUCCESS", "the operation completed successfully", (), ()),
    1: (
        "CUBLAS_STATUS_NOT_INITIALIZED",
        "cuBLAS could not be initialized: creating the handle failed",
        (
            "the GPU was out of memory when cuBLAS created its handle or workspace "
            "(cuBLAS allocates outside PyTorch's caching allocator)",
            "an earlier CUDA error left the context unusable",
            "the driver is older than the CUDA runtime torch was built with",
        ),
        (
            "free memory before the first matmul: a smaller batch, torch.cuda.empty_cache()",
            "rerun with CUDA_LAUNCH_BLOCKING=1 to find an earlier failing kernel",
            "run `python -m cublas_guard_ext doctor` to compare driver and runtime versions",
        ),
    ),
    3: (
        "CUBLAS_STATUS_ALLOC_FAILED",
        "an allocation inside cuBLAS failed (its workspace or internal buffers)",
        (
            "the GPU is out of memory",
            "memory fragmentation: free memory exists but not in one piece",
        ),
        (
            "lower the batch size, or call torch.cuda.empty_cache() before the failing step",
            "set a smaller cuBLAS workspace: CUBLAS_WORKSPACE_CONFIG=:4096:8",
            "check other processes on the GPU with nvidia-smi",
        ),
    ),
    7: (
        "CUBLAS_STATUS_INVALID_VALUE",
        "an argument was out of range (m, n, k < 0, a leading dimension too small, ...)",
        (
            "a size beyond cuBLAS's 32-bit int arguments",
            "a leading dimension smaller than the rows stored (a bad stride)",
        ),
        (
            "check the failed rule and the arguments below",
            "make the operands contiguous (x.contiguous()) and retry",
        ),
    ),
    8: (
        "CUBLAS_STATUS_ARCH_MISMATCH",
        "the GPU lacks a feature this cuBLAS call needs",
        (
            "the GPU is older than this cuBLAS/torch build supports",
            "the compute mode or data type needs a newer architecture",
        ),
        (
            "run `python -m cublas_guard_ext doctor`: it compares the GPU with torch's arch list",
            "install a torch build that supports this GPU (see pytorch.org/get-started)",
        ),
    ),
    11: (
        "CUBLAS_STATUS_MAPPING_ERROR",
        "cuBLAS could not access GPU memory (a texture or memory mapping failed)",
        (
            "an earlier CUDA error corrupted the context",
            "an operand pointer is invalid (freed or on another device)",
        ),
        (
            "rerun with CUDA_LAUNCH_BLOCKING=1",
            "restart the process: the context may be unusable",
        ),
    ),
    13: (
        "CUBLAS_STATUS_EXECUTION_FAILED",
        "the GEMM kernel failed to launch or to run on the GPU",
        (
            "an EARLIER asynchronous CUDA error surfacing here: an index out of range in "
            "nn.Embedding, a gather or a loss (a device-side assert) fails silently and the "
            "next cuBLAS call reports it",
            "out of GPU memory",
            "a GPU architecture the torch build does not support",
            "a hardware fault (overheating, a failing card)",
        ),
        (
            "rerun with CUDA_LAUNCH_BLOCKING=1 so the error is raised by the kernel that failed",
            "use mode='sync' (the default) so the guard names an earlier failure before the GEMM",
            "run `python -m cublas_guard_ext doctor`",
        ),
    ),
    14: (
        "CUBLAS_STATUS_INTERNAL_ERROR",
        "an operation inside cuBLAS failed (usually a CUDA call it made)",
        (
            "an earlier asynchronous CUDA error",
            "out of GPU memory",
            "a driver/runtime mismatch",
        ),
        (
            "rerun with CUDA_LAUNCH_BLOCKING=1",
            "run `python -m cublas_guard_ext doctor`",
        ),
    ),
    15: (
        "CUBLAS_STATUS_NOT_SUPPORTED",
        "this combination of parameters is not supported by cuBLAS on this GPU",
        ("a math mode (TF32) or data type the GPU does not offer",),
        (
            "disable TF32: torch.backends.cuda.matmul.allow_tf32 = False",
            "run `python -m cublas_guard_ext doctor`",
        ),
    ),
    16: (
        "CUBLAS_STATUS_LICENSE_ERROR",
        "the requested functionality needs a license that was not found",
        ("a cuBLAS feature behind a license check",),
        ("check the NVIDIA license configuration of this machine",),
    ),
}

_NAN_STORY = (
    "NaN/Inf do not make cuBLAS fail (a GEMM never looks at values: it returns NaN with "
    "status SUCCESS); the guard refuses them so they do not spread."
)
