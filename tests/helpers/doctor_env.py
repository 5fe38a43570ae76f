"""A synthetic doctor environment of a healthy one-GPU machine, for the doctor's checks on faked
facts (forensics/test_diagnostics.py, test_doctor_causes.py, test_doctor_libraries.py)."""

from __future__ import annotations

import torch

from cublas_guard_ext._native.machine import facts


def gpu_env(**changes) -> dict:
    """A synthetic environment of a machine with one GPU, for the GPU-side checks."""
    env = {
        "python": "3.11",
        "platform": "linux",
        "torch": torch.__version__,
        "torch_cuda": "13.0",
        "torch_arch_list": ["sm_80", "sm_90"],
        "cuda_available": True,
        "tf32": {
            "torch.backends.cuda.matmul.allow_tf32": False,
            "torch.get_float32_matmul_precision()": "highest",
        },
        "env": {name: None for name in facts.ENV_VARS},
        "extension": {
            "built_with_torch": torch.__version__,
            "cuda_compiled": True,
            "built_archs": "800,900",
            "cudart_runtime_version": 13000,
            "driver_version": 13000,
            "kind": "prebuilt",
            "path": "/x/_C.so",
        },
        "libraries": ["/nv/lib/libcublas.so.13.1.1", "/nv/lib/libcublasLt.so.13.1.1"],
        # What doctor's library_facts() gathers (tools/doctor_libraries.py), healthy.
        "cuda_libraries": {
            "loaded": {
                "libcublas": [{"path": "/nv/lib/libcublas.so.13.1.1", "version": "13.1.1"}],
                "libcublasLt": [{"path": "/nv/lib/libcublasLt.so.13.1.1", "version": "13.1.1"}],
            },
            "installed": {},
            "conflicts": [],
            "cublas_distributions": [{"name": "nvidia-cublas", "version": "13.1.1.3", "cuda_major": 13}],
            "lt_missing_symbols": [],
            "pip_toolkit_command": 'pip install "cuda-toolkit[nvcc,cccl]==13.0.3"',
        },
        "devices": [
            {
                "index": 0,
                "name": "NVIDIA H200",
                "compute_capability": "9.0",
                "free_memory": 100 << 30,
                "total_memory": 140 << 30,
                "torch_allocated": 0,
                "torch_reserved": 0,
            }
        ],
    }
    for path, value in changes.items():
        target = env
        keys = path.split(".")
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[keys[-1]] = value
    return env
