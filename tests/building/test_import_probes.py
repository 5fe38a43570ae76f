"""Importing the package and its first call run nothing: no compiler probe (`c++ --version`,
`nvcc --version`), no import of torch.utils.cpp_extension (which warns at import on a CUDA torch
without a GPU). The JIT key, which asks the compiler, is computed only to build or to load a
cached JIT build, and then the compiler is asked once per process.

The trap logs every call, `--version` probes included: a trap that only fails (`CXX=false`)
lets a probe pass unseen, since the probe's failure is caught and read as "not GCC"."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cublas_guard_ext._native.building import build as _build
from cublas_guard_ext._native.building import ninja_build as _ninja

TRAPPED = ("c++", "g++", "gcc", "cc", "clang", "clang++", "nvcc")


def _compiler_trap(folder: Path) -> tuple[Path, Path]:
    """A folder of fake compilers that append their command line to a log and fail."""
    folder.mkdir()
    log = folder / "calls.log"
    for name in TRAPPED:
        tool = folder / name
        tool.write_text(f'#!/bin/sh\necho "$0 $*" >> {log}\nexit 1\n')
        tool.chmod(0o755)
    return folder, log


def _locked_name(flavour: str, digest: str = "0123456789ab") -> str:
    return f"{_build._jit_name_prefix(flavour)}{digest}"


# ---------------------------------------------------------------------------
# The lookup by name: no probe
# ---------------------------------------------------------------------------
def test_an_empty_cache_holds_no_locked_build(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "none-yet"))
    assert not _build.locked_jit_build_may_exist()


@pytest.mark.parametrize("flavour", ["cpu", "cuda"])
def test_a_cached_locked_build_of_this_torch_is_seen(tmp_path: Path, monkeypatch, flavour: str) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / _locked_name(flavour)
    folder.mkdir()
    assert not _build.locked_jit_build_may_exist()  # a folder whose build never finished
    (folder / f"{folder.name}.so").write_bytes(b"")
    assert _build.locked_jit_build_may_exist()


@pytest.mark.parametrize("other", ["core_cpu", "another torch", "another python"])
def test_builds_the_locked_library_cannot_use_are_not_seen(tmp_path: Path, monkeypatch, other: str) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = _locked_name("core_cpu" if other == "core_cpu" else "cpu")
    if other == "another torch":
        name = name.replace(_build._jit_name_prefix("cpu").split("_py")[0], "cublas_guard_ext_cpu_torch9_9_9")
    if other == "another python":
        name = name.replace(f"_py{sys.version_info.major}{sys.version_info.minor}", "_py29")
    folder = tmp_path / name
    folder.mkdir()
    (folder / f"{name}.so").write_bytes(b"")
    assert not _build.locked_jit_build_may_exist()


def test_the_default_root_is_searched_across_accelerator_folders(tmp_path: Path, monkeypatch) -> None:
    import torch._appdirs

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(
        torch._appdirs, "user_cache_dir", lambda appname=None: str(tmp_path / "cache" / appname)
    )
    assert not _build.locked_jit_build_may_exist()
    folder = tmp_path / "cache" / "torch_extensions" / "py3x_cu999" / _locked_name("cuda")
    folder.mkdir(parents=True)
    (folder / f"{folder.name}.so").write_bytes(b"")
    assert _build.locked_jit_build_may_exist()


def test_the_jit_key_asks_the_compiler_once_per_process(tmp_path: Path, monkeypatch) -> None:
    trap, log = _compiler_trap(tmp_path / "trap")
    monkeypatch.setenv("CXX", str(trap / "c++"))
    monkeypatch.delenv("CUBLAS_GUARD_EXT_PCH", raising=False)
    _ninja._compiler_banner.cache_clear()
    try:
        plan = _build.plan(with_cuda=False)
        names = {_build.jit_name(plan) for _ in range(3)}
        assert len(names) == 1
        assert log.read_text().splitlines() == [f"{trap / 'c++'} --version"]
    finally:
        _ninja._compiler_banner.cache_clear()  # the next test's CXX is the real one again


# ---------------------------------------------------------------------------
# A user's process: import, first call
# ---------------------------------------------------------------------------
FIRST_CALL = textwrap.dedent(
    """
    import importlib.util, json, sys
    real_find_spec = importlib.util.find_spec
    def find_spec(name, *args, **kwargs):  # a wheel installed beside another torch: no usable _C
        return None if name == "cublas_guard_ext._C" else real_find_spec(name, *args, **kwargs)
    importlib.util.find_spec = find_spec
    import torch
    import cublas_guard_ext as cg
    layer = cg.SafeLinear(4, 3)
    layer(torch.randn(2, 4)).sum().backward()
    from cublas_guard_ext._native.loading import loader
    print(json.dumps({"library": loader.info().library,
                      "cpp_extension": "torch.utils.cpp_extension" in sys.modules}))
    """
)


@pytest.mark.slow
def test_importing_and_the_first_call_run_no_compiler(tmp_path: Path) -> None:
    if not any(Path(__import__("cublas_guard_ext").__file__).parent.glob("_core*.so")):
        pytest.skip("needs the prebuilt stable core (an editable install or the wheel)")
    trap, log = _compiler_trap(tmp_path / "trap")
    env = dict(
        os.environ,
        PATH=f"{trap}{os.pathsep}{os.environ.get('PATH', '')}",
        CC=str(trap / "cc"),
        CXX=str(trap / "c++"),
        NVCC=str(trap / "nvcc"),
        CUDA_HOME=str(trap.parent / "no-toolkit"),
        TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"),
        CUBLAS_GUARD_EXT_NATIVE="auto",
    )
    out = subprocess.run(
        [sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    result = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert result["library"] == "core", out.stdout
    assert not log.exists(), f"compilers were started: {log.read_text()}"
    assert result["cpp_extension"] is False, "torch.utils.cpp_extension was imported"
    assert "No CUDA runtime is found" not in out.stderr
