"""Fake CUDA toolkits and CUDA wheels (no GPU, no real nvcc) for the build tests; the
``cuda_facts`` fixture that combines them is in tests/building/conftest.py."""

from __future__ import annotations

from pathlib import Path

INCOMPATIBLE = '#error "CUDA compiler and CUDA toolkit headers are incompatible"\n'


def fake_toolkit(tmp_path: Path, release: str, with_cublas: bool = False) -> Path:
    """A CUDA_HOME whose nvcc reports ``release`` and whose runtime header says so."""
    root = tmp_path / f"cuda-{release}"
    (root / "bin").mkdir(parents=True)
    (root / "include" / "crt").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.88'\n")
    nvcc.chmod(0o755)
    major, minor = release.split(".")
    (root / "include" / "cuda_runtime.h").write_text(
        f"#define FAKE_CUDART {int(major) * 1000 + int(minor) * 10}\n"
    )
    (root / "include" / "crt" / "host_config.h").write_text("#define FAKE_TOOLKIT_CRT 1\n")
    if with_cublas:
        (root / "include" / "cublas_v2.h").write_text("#define FAKE_CUBLAS 0\n")
    return root


def fake_cuda_wheel(tmp_path: Path) -> Path:
    """site-packages/nvidia/cu13/include as torch 2.15's CUDA 13.2 wheels lay it out: the
    libraries' headers next to runtime headers a 13.0 nvcc rejects."""
    include = tmp_path / "site-packages" / "nvidia" / "cu13" / "include"
    (include / "crt").mkdir(parents=True)
    (include / "cuda_runtime.h").write_text(INCOMPATIBLE)
    (include / "crt" / "host_config.h").write_text(INCOMPATIBLE)
    (include / "cublas_v2.h").write_text('#include <cuda_runtime.h>\n#include "cublas_api.h"\n')
    (include / "cublas_api.h").write_text("#define FAKE_CUBLAS 1\n")
    (include / "cublasLt.h").write_text("#include <cuda_runtime.h>\n")
    (include / "cusparse.h").write_text("#include <cuda_runtime.h>\n")
    return include
