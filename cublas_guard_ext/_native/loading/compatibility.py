"""Which builds can load beside this torch and Python, known by names alone: the stable core's
torch floor and the names of the JIT builds in torch's cache.

The loader asks this on every import (is torch new enough for the prebuilt core? is a locked
JIT build of this torch cached?), so it imports nothing but the standard library and torch,
probes no compiler and leaves ``torch.utils.cpp_extension`` unimported (its import warns on a
CUDA torch without a GPU). The build (``building/build.py``, ``building/core_build.py``) uses
the same names; like them this file is also loaded by path from setup.py, so it imports
nothing of the package.
"""

from __future__ import annotations

import glob
import os
import re
import sys

# The oldest torch the stable core runs on: 2.10 is the first release whose shim has the
# pieces the core calls (torch_call_dispatcher, the cuBLAS handle of the current stream,
# std::string/std::vector arguments in boxed kernels) and the first that enforces shim versions.
FLOOR = (2, 10)


def torch_floor_error(torch_version: str) -> str | None:
    """Why the stable core cannot load beside ``torch_version`` (below FLOOR), or None."""
    parts = torch_version.split("+")[0].split(".")
    try:
        version = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return None  # a development build we cannot read: let the load decide
    if version >= FLOOR:
        return None
    floor = "{}.{}".format(*FLOOR)
    return (
        f"cublas_guard_ext's prebuilt core needs torch >= {floor} (the oldest stable ABI it "
        f"uses); this is torch {torch_version}. Upgrade torch (pip install 'torch>={floor}'), "
        "or build the version-locked library for this torch from a source checkout "
        "(pip install --no-build-isolation -e .)"
    )


def jit_name_prefix(flavour: str) -> str:
    """A JIT build's name up to its key digest: what can be known without probing a compiler."""
    import torch

    torch_tag = re.sub(r"[^A-Za-z0-9]", "_", torch.__version__)
    py_tag = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return f"cublas_guard_ext_{flavour}_torch{torch_tag}_{py_tag}_"


def locked_jit_build_may_exist() -> bool:
    """Whether a JIT build of the locked library for this torch and Python may be cached, by
    names alone: no compiler probed, torch.utils.cpp_extension not imported (its import warns
    on a CUDA torch without a GPU). A superset of the real lookup, which needs the full key
    (compiler, toolkit, flags): False means there is certainly none; True, look properly."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        pattern_root = glob.escape(root)
    else:
        try:  # torch's default root, one folder per accelerator below it (py311_cpu, py312_cu130...)
            import torch._appdirs

            default_root = os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions"))
        except Exception:  # another torch's layout: look the slow, certain way
            return True
        pattern_root = os.path.join(glob.escape(default_root), "*")
    return any(
        glob.glob(os.path.join(pattern_root, jit_name_prefix(flavour) + "*", "*.so"))
        for flavour in ("cpu", "cuda")
    )
