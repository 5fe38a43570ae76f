"""_native's one folder per job (building/, loading/, core_twins/, machine/): importing the
package imports nothing of building/ (nor torch.utils.cpp_extension, whose import warns on a
CUDA torch without a GPU), every old flat path is the moved module itself, and the guarded ops
read the loaded library through the one seam (_native/loading/seam.py)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cublas_guard_ext
from cublas_guard_ext import _module_aliases
from cublas_guard_ext._native.loading import seam as _seam

NATIVE_DIR = Path(cublas_guard_ext.__file__).resolve().parent / "_native"
IMPORTED = (
    "import json, sys, cublas_guard_ext\n"
    "print(json.dumps(sorted(m for m in sys.modules if m.startswith('cublas_guard_ext._native')"
    " or m.startswith('torch.utils.cpp_extension'))))"
)


# The wheel's _C made for another torch (the version matrix: torch 2.11 and 2.15 beside a _C of
# 2.14.1): auto then looks for a cached JIT build of the locked library, by names alone.
HIDE_C = (
    "import importlib.machinery, sys\n"
    "class _NoC:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        return importlib.machinery.ModuleSpec(name, None) if name == 'cublas_guard_ext._C' else None\n"
    "sys.meta_path.insert(0, _NoC())\n"
)


@pytest.mark.parametrize("library", ["auto", "core", "auto-without-its-C"])
def test_importing_the_package_imports_no_build_module(library: str, tmp_path: Path) -> None:
    env = dict(os.environ, CUBLAS_GUARD_EXT_NATIVE=library.split("-")[0])
    script = IMPORTED
    if library == "auto-without-its-C":
        env["TORCH_EXTENSIONS_DIR"] = str(tmp_path)  # no cached build of the locked library
        script = HIDE_C + IMPORTED
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert "cublas_guard_ext._native.loading.loader" in imported  # the probe sees the package's modules
    building = [m for m in imported if ".building" in m or m.rpartition(".")[2] in _building_leaves()]
    assert building == [], f"importing cublas_guard_ext imported {building}"
    assert "torch.utils.cpp_extension" not in imported


def _building_leaves() -> set[str]:
    return {leaf for leaf, folder in _module_aliases.NATIVE_MOVED.items() if folder == "building"}


def test_every_flat_module_moved_into_a_folder_of_its_job() -> None:
    flat = sorted(p.stem for p in NATIVE_DIR.glob("*.py") if p.stem != "__init__")
    assert flat == [], f"_native/ holds modules outside its folders: {flat}"
    for leaf, folder in _module_aliases.NATIVE_MOVED.items():
        assert (NATIVE_DIR / folder / f"{leaf}.py").is_file(), (leaf, folder)
    folders = sorted(p.name for p in NATIVE_DIR.iterdir() if (p / "__init__.py").is_file())
    assert folders == ["building", "core_twins", "loading", "machine"]
    for name in folders:  # each folder says why it is one
        assert len(importlib.import_module(f"cublas_guard_ext._native.{name}").__doc__ or "") > 200, name


@pytest.mark.parametrize("leaf", sorted(_module_aliases.NATIVE_MOVED))
def test_each_old_path_is_the_moved_module(leaf: str) -> None:
    new_name = f"cublas_guard_ext._native.{_module_aliases.NATIVE_MOVED[leaf]}.{leaf}"
    old = importlib.import_module(f"cublas_guard_ext._native.{leaf}")
    new = importlib.import_module(new_name)
    assert old is new
    assert getattr(importlib.import_module("cublas_guard_ext._native"), leaf) is new
    assert new.__name__ == new_name and new.__spec__.name == new_name  # its own spec, kept
    assert sys.modules[f"cublas_guard_ext._native.{leaf}"] is new


def test_an_unknown_native_name_is_no_module() -> None:
    native = importlib.import_module("cublas_guard_ext._native")
    with pytest.raises(AttributeError, match="'cublas_guard_ext._native' has no attribute 'nothing'"):
        native.nothing  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("cublas_guard_ext._native.nothing")


def test_an_old_path_imported_first_in_a_fresh_process_is_the_moved_module() -> None:
    code = (
        "import sys\nfrom cublas_guard_ext._native import build, toolkit\n"
        "import cublas_guard_ext._native.stable_core_grouped as grouped\n"
        "m = sys.modules\n"
        "print(build is m['cublas_guard_ext._native.building.build'],"
        " toolkit is m['cublas_guard_ext._native.building.toolkit'],"
        " grouped is m['cublas_guard_ext._native.core_twins.stable_core_grouped'])"
    )
    out = subprocess.run(
        [sys.executable, "-W", "error::ImportWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split() == ["True", "True", "True"], out.stderr


def test_the_ops_read_the_loaded_library_through_the_seam() -> None:
    from cublas_guard_ext.guarded_linear import ops

    seam = _seam.seam()
    assert seam.info is _seam._loader.info()
    assert ops._fast_linear is seam.fast_linear
    assert ops._cuda_first_use_done is seam.cuda_first_use_done
    if seam.info.library == "core":
        from cublas_guard_ext._native.core_twins import stable_core

        # The C entry where torch has the stable ABI's Python shims, else the Python twin
        # (tests/linear/test_core_entry.py holds them to the same decisions).
        if stable_core.c_entry(seam.info.path) is None:
            assert seam.fast_linear is stable_core.fast_linear
        else:
            assert type(seam.fast_linear).__name__ == "builtin_function_or_method"
            assert seam.fast_linear.__name__ == "fast_linear"
        assert (seam.has_watch, seam.fast_linear_reads_mode_env) == (False, False)
        assert type(seam.watch_methods("owner")).__name__ == "LockedOnly"
    else:
        assert seam.has_watch and seam.fast_linear_reads_mode_env
        assert seam.watch_methods("owner") is sys.modules["cublas_guard_ext._C"]
        assert seam.typed_errors(len) is len  # the locked library raises typed errors itself


@pytest.mark.parametrize("library", ["core", "locked"])
def test_the_seam_types_the_cores_errors_only(library: str) -> None:
    from cublas_guard_ext._native.core_twins import stable_core

    info = _seam._loader.NativeInfo("prebuilt", "lib.so", False, "test", library=library)
    seam = _seam.Seam(info, None, None, library == "locked", library == "locked")

    def fails() -> None:
        raise RuntimeError(f"linear failed {stable_core._VALUE_TAG}in_features 3 != weight columns 4")

    wrapped = seam.typed_errors(fails)
    if library == "locked":
        assert wrapped is fails  # the locked library raises typed errors from C++
        return
    with pytest.raises(ValueError, match=r"^in_features 3 != weight columns 4$"):
        wrapped()
