"""The two ways the native library is obtained: the installed build and the JIT
build, each in its own process (and the JIT one in its own build directory)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from cublas_guard_ext._native.building import build as _build  # noqa: E402
from cublas_guard_ext._native.building import unity_build as _unity  # noqa: E402

# The JIT build compiles csrc/: only a source checkout has it (an installed wheel does not).
needs_sources = pytest.mark.skipif(
    not (_build.CSRC_DIR / "ops.cpp").exists(), reason="the JIT build needs a source checkout"
)

SMOKE = textwrap.dedent(
    """
    import torch, cublas_guard_ext as cg
    from cublas_guard_ext._native.loading import loader as _loader
    info = _loader.info()
    print("KIND", info.kind, "CUDA", info.has_cuda_kernels)
    layer = cg.SafeLinear(8, 3, name="smoke")
    x = torch.randn(4, 8)
    assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-6)
    x[2, 5] = float("nan")
    try:
        layer(x)
    except cg.NonFiniteInputError as err:
        assert err.first_bad_coords == [2, 5], err.fields
        print("TYPED", type(err).__name__)
    """
)


def run(code: str, env: dict[str, str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CUBLAS_GUARD_EXT_FORCE_JIT", None)
    return env


@pytest.mark.slow
def test_installed_build_is_used(tmp_path: Path) -> None:
    result = run(SMOKE, base_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "KIND prebuilt" in result.stdout and "TYPED NonFiniteInputError" in result.stdout


@pytest.mark.slow
@needs_sources
def test_jit_build_in_its_own_directory(tmp_path: Path, monkeypatch) -> None:
    if os.environ.get("CUBLAS_GUARD_EXT_TESTS_JIT_CPU_ONLY") == "1":
        # .ci/cuda_build_check.sh: the C++ only there (the version matrix JIT-builds the CUDA
        # kernels from an installed wheel); set here too, for the build directory's key below.
        monkeypatch.setenv("CUBLAS_GUARD_EXT_FORCE_CPU", "1")
    env = base_env()
    env["CUBLAS_GUARD_EXT_FORCE_JIT"] = "1"
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext")
    result = run(SMOKE, env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "KIND jit" in result.stdout and "TYPED NonFiniteInputError" in result.stdout
    built = list((tmp_path / "ext").rglob("*.so"))
    assert built, "the JIT build must land in TORCH_EXTENSIONS_DIR"
    # In the directory keyed by this environment (prefix, torch, Python ABI, flags).
    from cublas_guard_ext._native.loading import loader as _loader

    expected = Path(_loader.jit_build_directory(_build.plan(), prefix=sys.prefix))
    assert {p.parent.name for p in built} == {expected.name}
    # A cold build does not sit silent: which file, n of N, seconds, on stderr.
    # A NOTE comes first when there is one (nvcc 13.0 with torch 2.15's CUDA 13.2): then the build's lines.
    progress = [
        line
        for line in result.stderr.splitlines()
        if line.startswith(_build.PROGRESS_PREFIX) and not line.startswith(f"{_build.PROGRESS_PREFIX} NOTE: ")
    ]
    assert "JIT build" in progress[0] and str(tmp_path / "ext") in progress[0], progress
    steps = [line for line in progress if "] " in line and " s  " in line]
    names = {line.rsplit(" ", 1)[1] for line in steps}
    # What the build compiles: one file per unity group (unity_core.cpp, unity_locked.cpp), which
    # need no PCH (CUBLAS_GUARD_EXT_UNITY=0, each source and the PCH).
    compiled = _unity.unity_sources(_build.plan().sources, tmp_path / "unity")
    assert {Path(s).name for s in compiled} <= names, progress
    unity = _unity.unity_enabled()
    assert unity == (len(compiled) < len(_build.plan().sources)), compiled
    total = len(compiled) + 1 + (1 if _build.pch_enabled() and not unity else 0)  # + link (+ PCH)
    assert steps[-1].split("]")[0].endswith(f"[{total}/{total}"), progress
    assert progress[-1].startswith(f"{_build.PROGRESS_PREFIX} done in "), progress
    # A second import reuses the cached build (no recompile: fast) and prints nothing.
    again = run(SMOKE, env, cwd=tmp_path, timeout=120)
    assert again.returncode == 0 and "KIND jit" in again.stdout
    assert _build.PROGRESS_PREFIX not in again.stderr, again.stderr


@needs_sources
def test_jit_without_ninja_raises_a_typed_build_error(tmp_path: Path) -> None:
    # A PATH with a C++ compiler but no ninja.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    compiler = shutil.which("c++")
    assert compiler, "a C++ compiler is needed for this test"
    (bin_dir / "c++").symlink_to(compiler)
    env = base_env()
    env["CUBLAS_GUARD_EXT_FORCE_JIT"] = "1"
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext")
    env["PATH"] = str(bin_dir)
    code = textwrap.dedent(
        """
        try:
            import cublas_guard_ext
        except ImportError as err:
            # the package failed to import, so check the class by name
            assert type(err).__name__ == "ExtensionBuildError", type(err)
            print("MISSING", err.missing)
            print(err)
        """
    )
    result = run(code, env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "MISSING ninja" in result.stdout and "pip install ninja" in result.stdout


def _elf_needed(path: str) -> list[str]:
    """DT_NEEDED entries of a 64-bit little-endian ELF shared object (no readelf needed)."""
    import struct

    data = Path(path).read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a 64-bit little-endian ELF"
    (e_shoff,) = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    dynamic = next(s for s in sections if s[1] == 6)  # SHT_DYNAMIC
    strtab = sections[dynamic[6]]  # sh_link: the string table the entries index
    names = []
    for offset in range(dynamic[4], dynamic[4] + dynamic[5], 16):
        tag, value = struct.unpack_from("<qQ", data, offset)
        if tag == 0:
            break
        if tag == 1:  # DT_NEEDED
            start = strtab[4] + value
            names.append(data[start : data.index(b"\0", start)].decode())
    return names


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF shared objects: Linux only")
def test_the_extension_links_the_shared_libstdcxx_torch_uses() -> None:
    # On the GPU machine (its g++ links libstdc++ statically) a build without libstdc++.so.6
    # among its NEEDED libraries crashed in its first error message that formatted an integer.
    import torch

    from cublas_guard_ext._native.loading import loader

    needed = _elf_needed(loader.info().path)
    assert "libstdc++.so.6" in needed, needed
    torch_needed = _elf_needed(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    assert "libstdc++.so.6" in torch_needed  # the runtime it must share with torch


def test_the_link_plan_puts_libstdcxx_first_and_drops_static_runtime_flags() -> None:
    plan = _build.plan(with_cuda=False)
    assert plan.libraries[0].startswith(":libstdc++.so.6"), plan.libraries
    assert (Path(plan.library_dirs[0]) / plan.libraries[0][1:]).is_file()
    command = ["g++", "-shared", "-static-libstdc++", "-Wl,-O1", "-static-libgcc"]
    assert _build.without_static_runtime(command) == ["g++", "-shared", "-Wl,-O1"]
