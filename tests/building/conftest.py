"""Fixtures of the build tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cublas_guard_ext._native.building import toolkit as _toolkit

from helpers.cuda_toolkit import fake_cuda_wheel, fake_toolkit


@pytest.fixture
def cuda_facts(tmp_path: Path, monkeypatch):
    """A CUDA 13.2 torch with its wheels, and a toolkit of the release the test asks for."""
    from torch.utils import cpp_extension

    wheel = fake_cuda_wheel(tmp_path)
    monkeypatch.setattr(torch.version, "cuda", "13.2")
    monkeypatch.setattr(_toolkit, "cublas_include_dirs", lambda: [str(wheel)])
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)  # apply_env sets it
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    for name in (
        "TORCH_CUDA_ARCH_LIST",
        "CUDA_HOME",
        "CUDA_PATH",
        "FORCE_CUDA",
        "CUBLAS_GUARD_EXT_FORCE_CPU",
    ):
        monkeypatch.setenv(name, "")  # recorded, so the test's own changes are undone too
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def use(release: str, with_cublas: bool = False) -> Path:
        root = fake_toolkit(tmp_path, release, with_cublas)
        monkeypatch.setattr(_toolkit, "find_cuda_home", lambda: str(root))
        return root

    use.wheel = wheel
    return use
