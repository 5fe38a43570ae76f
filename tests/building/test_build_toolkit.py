"""Where the CUDA toolkit comes from and what the JIT key is made of: one key per build
however the process started (TORCH_EXTENSIONS_DIR differs between a parent and its
subprocess), nvcc's release in the key, pip's toolkit (site-packages/nvidia/cuNN) when there
is no system one, its versioned runtime linked by name, and the pip command when there is no
toolkit at all. Faked toolkits: no GPU, no real nvcc."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cublas_guard_ext._native.building import build as _build
from cublas_guard_ext._native.building import toolkit as _toolkit

from helpers.cuda_toolkit import fake_toolkit


def test_the_jit_key_does_not_depend_on_torch_extensions_dir(tmp_path: Path, cuda_facts, monkeypatch) -> None:  # noqa: F811 (the fixture)
    # torch 2.15 + nvcc 13.0: the private folder of the wheel's cuBLAS headers lives under
    # TORCH_EXTENSIONS_DIR; a subprocess with its own TORCH_EXTENSIONS_DIR must still compute
    # the name its parent computes.
    cuda_facts("13.0")
    names, private = set(), []
    for folder in ("parent-ext", "child-ext"):
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / folder))
        plan = _build.plan(with_cuda=True)
        [after] = plan.include_dirs_after
        private.append(after)
        names.add(_build.jit_name(plan))
    assert private[0] != private[1] and Path(private[0]).name == Path(private[1]).name
    assert len(names) == 1, names


def test_the_jit_key_names_the_toolkit_and_its_nvcc(tmp_path: Path, cuda_facts) -> None:  # noqa: F811 (the fixture)
    root = cuda_facts("13.0")
    plan = _build.plan(with_cuda=True)
    key = _build.jit_cache_key(plan)
    assert key["nvcc"] == "13.0" and key["cuda_home"] == os.path.realpath(root)
    # Another nvcc (another toolkit) is another build.
    cuda_facts("13.2", with_cublas=True)
    other = _build.plan(with_cuda=True)
    assert _build.jit_cache_key(other)["nvcc"] == "13.2" and _build.jit_name(other) != _build.jit_name(plan)
    # A CPU build carries no toolkit facts.
    cpu = _build.jit_cache_key(_build.plan(with_cuda=False))
    assert cpu["nvcc"] is None and cpu["cuda_home"] is None


def fake_pip_toolkit(site: Path, release: str = "13.0", with_nvcc: bool = True) -> Path:
    """site-packages/nvidia/cu13 as `pip install "cuda-toolkit[nvcc,cccl]==13.0.3"` lays it
    out: bin/nvcc, include/ (runtime and cuBLAS headers), lib/libcudart.so.13 only."""
    root = site / "nvidia" / f"cu{release.split('.')[0]}"
    (root / "include").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("#define FAKE_CUDART 13000\n")
    (root / "include" / "cublas_v2.h").write_text("#define FAKE_CUBLAS 1\n")
    (root / "lib" / "libcudart.so.13").write_text("")
    if with_nvcc:
        (root / "bin").mkdir()
        nvcc = root / "bin" / "nvcc"
        nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.88'\n")
        nvcc.chmod(0o755)
    return root


@pytest.fixture
def pip_only(tmp_path: Path, cuda_facts, monkeypatch):  # noqa: F811 (the fixture)
    """A CUDA 13.0 torch on a machine whose system toolkit is hidden; site-packages in tmp."""
    site = tmp_path / "venv" / "site-packages"  # cuda_facts has its own tmp_path/site-packages
    site.mkdir(parents=True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_toolkit, "_site_dirs", lambda: [str(site)])
    monkeypatch.setattr(_toolkit, "cublas_include_dirs", lambda: [])
    monkeypatch.setattr(_toolkit, "torch_cuda_pins", lambda *a: {"cuda-toolkit": "13.0.3"})
    monkeypatch.setenv(_toolkit.IGNORE_SYSTEM_CUDA_ENV, "1")
    return site


def test_pips_toolkit_is_found_and_its_versioned_runtime_linked(pip_only, tmp_path: Path) -> None:
    root = fake_pip_toolkit(pip_only)
    assert _toolkit.find_cuda_home() == str(root)
    with_cuda, reason = _build.decide_cuda()
    assert with_cuda, reason
    plan = _build.plan()
    assert plan.with_cuda and plan.cuda_home == str(root) and plan.cudart_library == ":libcudart.so.13"
    assert str(root / "lib") in plan.library_dirs
    # torch writes -lcudart into the JIT build's ninja file: the hook links the file by name.
    ninja = tmp_path / "build.ninja"
    ninja.write_text("ldflags = -shared -L/x/lib -lcudart -lc10_cuda -ltorch_cuda\nlink = -lcudart\n")
    _build.link_cudart_by_name(str(ninja), plan.cudart_library)
    assert ninja.read_text() == (
        "ldflags = -shared -L/x/lib -l:libcudart.so.13 -lc10_cuda -ltorch_cuda\nlink = -l:libcudart.so.13\n"
    )
    # A toolkit of torch's major only: a cu12 folder is not taken for a CUDA 13 torch.
    assert _toolkit.find_pip_toolkit("12.8") is None


def test_no_toolkit_at_all_builds_cpu_only_and_names_the_pip_command(pip_only, monkeypatch) -> None:
    fake_pip_toolkit(pip_only, with_nvcc=False)  # torch's own runtime wheel, no nvcc
    assert _toolkit.find_cuda_home() is None
    with_cuda, reason = _build.decide_cuda()
    assert not with_cuda
    assert reason.startswith("WARNING: the extension has no CUDA kernels (no CUDA toolkit (nvcc) was found")
    assert 'Fix: pip install "cuda-toolkit[nvcc,cccl]==13.0.3"' in reason
    monkeypatch.setenv("FORCE_CUDA", "1")
    with pytest.raises(RuntimeError, match=r'pip install "cuda-toolkit\[nvcc,cccl\]==13\.0\.3"'):
        _build.decide_cuda()


def test_a_system_toolkit_comes_before_pips(pip_only, cuda_facts, monkeypatch) -> None:  # noqa: F811 (the fixture)
    fake_pip_toolkit(pip_only)
    system = fake_toolkit(pip_only.parent, "13.0", with_cublas=True)
    monkeypatch.setenv("CUDA_HOME", str(system))
    assert _toolkit.find_cuda_home().endswith("nvidia/cu13")  # hidden: pip's
    monkeypatch.delenv(_toolkit.IGNORE_SYSTEM_CUDA_ENV)
    assert _toolkit.find_cuda_home() == str(system)
    assert _toolkit.cudart_link_name(str(system)) is None  # nothing there, torch's -lcudart decides
