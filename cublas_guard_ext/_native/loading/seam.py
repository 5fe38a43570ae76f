"""The one seam between the package and whichever native library loaded: what callers ask of
it, answered here, so that no caller branches on which library loaded or reads ``sys.modules``.

The version-locked library (``_C``, prebuilt or JIT) has a C++ fast eager entry that reads
``CUBLAS_GUARD_MODE`` itself, raises typed errors from C++, and holds watch's methods. The
stable core has a C fast entry where torch has the stable ABI's Python shims (2.14 on;
csrc/python_entry_stable.cpp) and a Python twin of it elsewhere (core_twins/stable_core.py),
both given the mode's code and raising the typed errors; and no watch (a stand-in that says
how to build the locked library).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from . import loader as _loader

F = TypeVar("F", bound=Callable[..., Any])
_LOCKED_MODULE = "cublas_guard_ext._C"


@dataclass(frozen=True)
class Seam:
    """What the loaded native library offers the Python side."""

    info: _loader.NativeInfo
    # The fast eager entry (x, weight, bias, layer, mode code, scan_grad) -> tensor or None
    # (None: take torch.ops); None where the library has none (a JIT build of the locked one).
    fast_linear: Callable[..., Any] | None
    # Tells the fast entry that CUDA device ``index`` had its first-use diagnostics, or None.
    cuda_first_use_done: Callable[[int], None] | None
    # True: pass codes.MODE_ENV_DEFAULT for "the default mode" and the entry reads
    # CUBLAS_GUARD_MODE itself; False: pass the default mode's own code.
    fast_linear_reads_mode_env: bool
    # Whether watch's native methods exist (the locked library's); see watch_methods().
    has_watch: bool

    def typed_errors(self, fn: F) -> F:
        """``fn`` raising the package's typed errors for the native library's failures (the
        core's cross the stable ABI as RuntimeError with the payload line); ``fn`` itself where
        the library raises them typed already."""
        if self.info.library != "core":
            return fn
        from ..core_twins import stable_core

        return stable_core.typed_errors(fn)

    def watch_methods(self, owner: str) -> Any:
        """The object holding watch's native methods (``_watch_begin``...): the locked library's
        Python module, installed first under a JIT build (no module of its own); under the core,
        a stand-in whose questions answer "nothing watched" and whose other calls raise
        ``locked_library_missing`` naming ``owner``."""
        if not self.has_watch:
            from ..core_twins.stable_core import LockedOnly

            return LockedOnly(owner)
        if _LOCKED_MODULE not in sys.modules:  # a JIT build: the same methods, installed as the module
            import torch

            torch.ops.cublas_guard_internal.python_module_install.default()
        return sys.modules[_LOCKED_MODULE]


@functools.cache
def seam() -> Seam:
    """The seam of the library this process loaded (loading it if needed)."""
    info = _loader.load()
    if info.library == "core":
        from ..core_twins import stable_core

        # The core's C entry where torch has the stable ABI's Python shims (2.14 on), else
        # its Python twin: the same decisions (csrc/python_entry_stable.cpp).
        entry = stable_core.c_entry(info.path)
        if entry is not None:
            return Seam(info, entry[0], entry[1], False, False)
        return Seam(info, stable_core.fast_linear, stable_core.cuda_first_use_done, False, False)
    locked = sys.modules.get(_LOCKED_MODULE) if info.kind == "prebuilt" else None
    return Seam(
        info,
        getattr(locked, "_fast_linear", None),
        getattr(locked, "_cuda_first_use_done", None),
        True,
        True,
    )
