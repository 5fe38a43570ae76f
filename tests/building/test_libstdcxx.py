"""The native library shares torch's C++ runtime instead of carrying its own.

On the GPU machine a build that carried its own copy of libstdc++'s locale and iostream code
(g++ linking it statically) crashed the interpreter in the first error message that formatted an
integer: two copies of std::locale's static state, one initialised. The proof has three parts,
each read from the built file or seen in a fresh process: libstdc++.so.6 is among the ELF NEEDED
entries; the dynamic symbol table DEFINES no std::locale / std::ios_base symbol (a static copy
would define them); and a guarded call whose error message formats integers raises its typed
error in a subprocess instead of crashing it. benchmarks/gpu/gpu_check.sh runs this file first, so on
a GPU machine the CUDA build is checked too.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import HAS_CUDA

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF shared objects: Linux only")

SHT_DYNAMIC, SHT_DYNSYM, SHN_UNDEF, DT_NEEDED = 6, 11, 0, 1
# Itanium-mangled prefixes of the classes whose static state must exist once per process.
RUNTIME_STATE_PREFIXES = (
    "_ZNSt6locale",
    "_ZNKSt6locale",
    "_ZNSt8ios_base",
    "_ZNKSt8ios_base",
    "_ZNSt7__cxx116locale",
    "_ZNSt3__16locale",
)


def _sections(data: bytes) -> list[tuple]:
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a 64-bit little-endian ELF"
    (e_shoff,) = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
    return [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]


def _cstr(data: bytes, start: int) -> str:
    return data[start : data.index(b"\0", start)].decode()


def elf_needed(path: str) -> list[str]:
    data = Path(path).read_bytes()
    sections = _sections(data)
    dynamic = next(s for s in sections if s[1] == SHT_DYNAMIC)
    strtab = sections[dynamic[6]]  # sh_link: the string table its entries index
    names = []
    for offset in range(dynamic[4], dynamic[4] + dynamic[5], 16):
        tag, value = struct.unpack_from("<qQ", data, offset)
        if tag == 0:
            break
        if tag == DT_NEEDED:
            names.append(_cstr(data, strtab[4] + value))
    return names


def elf_dynamic_symbols(path: str) -> list[tuple[str, bool]]:
    """(name, defined) for every entry of .dynsym; defined = its section index is not SHN_UNDEF."""
    data = Path(path).read_bytes()
    sections = _sections(data)
    dynsym = next(s for s in sections if s[1] == SHT_DYNSYM)
    strtab = sections[dynsym[6]]
    entry = dynsym[9] or 24  # sh_entsize
    symbols = []
    for offset in range(dynsym[4], dynsym[4] + dynsym[5], entry):
        st_name, _info, _other, st_shndx = struct.unpack_from("<IBBH", data, offset)
        if st_name:
            symbols.append((_cstr(data, strtab[4] + st_name), st_shndx != SHN_UNDEF))
    return symbols


def defined_runtime_state(path: str) -> list[str]:
    return [n for n, defined in elf_dynamic_symbols(path) if defined and n.startswith(RUNTIME_STATE_PREFIXES)]


def library_path() -> str:
    from cublas_guard_ext._native.loading import loader

    return loader.info().path


def test_libstdcxx_so6_is_needed() -> None:
    assert "libstdc++.so.6" in elf_needed(library_path())


def test_no_locale_or_ios_base_symbol_is_defined() -> None:
    symbols = elf_dynamic_symbols(library_path())
    # The library does use them (every error message goes through an ostream): they are
    # imported, from the shared libstdc++, never defined here.
    used = [n for n, defined in symbols if not defined and n.startswith(RUNTIME_STATE_PREFIXES)]
    assert used, "expected undefined (imported) std::locale / std::ios_base references"
    assert defined_runtime_state(library_path()) == []


def test_the_symbol_reader_sees_the_definitions_in_libstdcxx_itself() -> None:
    """The reader can fail: on libstdc++.so.6 itself it finds the definitions."""
    import torch  # noqa: F401  (torch's libraries load libstdc++.so.6)

    mapped = {
        line.split()[-1]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if "/libstdc++.so.6" in line
    }
    assert mapped, "libstdc++.so.6 is not loaded in this process"
    assert any(n.startswith("_ZNSt6locale") for n in defined_runtime_state(sorted(mapped)[0]))


@pytest.mark.skipif(shutil.which("nm") is None, reason="binutils' nm not installed")
def test_nm_agrees() -> None:
    result = subprocess.run(
        ["nm", "-D", "--defined-only", library_path()], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    names = [line.split()[-1] for line in result.stdout.splitlines() if line.strip()]
    assert [n for n in names if n.startswith(RUNTIME_STATE_PREFIXES)] == []


FORMATS_INTEGERS = textwrap.dedent(
    """
    import sys, torch, cublas_guard_ext as cg
    device = sys.argv[1]
    layer = cg.SafeLinear(8, 3, device=device, name="ints")
    try:  # the shape report: sizes formatted in the native message
        layer(torch.randn(4, 5, device=device))
    except cg.GuardError as err:
        print("SHAPE", type(err).__name__, err)
    try:  # a TORCH_CHECK whose message streams IntArrayRefs through an ostream
        torch.ops.cublas_guard.linear_grad_weight(torch.randn(2, 3, device=device),
                                                   torch.randn(2, 2, 4, device=device), "ints")
    except (ValueError, RuntimeError) as err:
        print("DIMS", type(err).__name__, str(err).splitlines()[0])
    x = torch.randn(4, 8, device=device)
    x[1, 6] = float("nan")
    try:  # counts and coordinates
        layer(x)
    except cg.NonFiniteInputError as err:
        print("COUNTS", err.fields["nan_count"], err.first_bad_coords)
    print("ALIVE")
    """
)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_CUDA else []))
def test_an_error_that_formats_integers_raises_in_a_fresh_process(device: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", FORMATS_INTEGERS, device],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert result.returncode == 0, f"rc={result.returncode}\n{result.stdout}\n{result.stderr}"
    lines = result.stdout.splitlines()
    shape = next(line for line in lines if line.startswith("SHAPE"))
    assert "ShapeError" in shape or "Error" in shape.split()[1], shape
    assert "5" in shape and "8" in shape, shape
    dims = next(line for line in lines if line.startswith("DIMS"))
    assert "[2, 3]" in dims and "[2, 2, 4]" in dims, dims
    assert "COUNTS 1 [1, 6]" in lines and lines[-1] == "ALIVE"
