"""The module paths of the flat layout (every module beside ``__init__``), still importable.

A model saved with ``torch.save(model)`` names the class's module (``cublas_guard_ext.nn``),
and users' code and docs name the others: each old path is the module that now holds that
code, the same object (``sys.modules``), so pickles load, ``import cublas_guard_ext.nn``
works and a monkeypatch through an old path changes the code that runs.

``cublas_guard_ext.watch`` stays the public class: ``import cublas_guard_ext.watch`` still
loads, but the attribute (and ``import cublas_guard_ext.watch as w``) is the class; the
module is ``cublas_guard_ext.watching.session``, a name nothing hides.

``_native``'s flat modules moved into one folder per job (``NATIVE_MOVED``). Those old paths
are aliased lazily, when first imported or read as an attribute of ``_native``: importing the
package must not import the build (``torch.utils.cpp_extension`` warns at import on a CUDA
torch without a GPU) nor modules it does not use. ``_NativeAliasFinder`` answers an import of
an old path with the moved module itself, and ``_native.__getattr__`` reads one the same way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

# old path (under cublas_guard_ext.) -> the module that holds its code now
MOVED = {
    "nn": "guarded_linear.nn",
    "ops": "guarded_linear.ops",
    "modes": "guarded_linear.modes",
    "_transforms": "guarded_linear._transforms",
    "watch": "watching.session",
    "_watch_patches": "watching.global_patches",
    "_training_state": "training.state",
    "_capsule_file": "capsule.safe_read",
    "capsule_replay": "capsule.replaying",
    "swap": "models.swap",
    # renamed apart from run/runtime.py and run/steps.py, which are other things
    "errors.runtime": "errors.cuda_runtime",
    "errors.steps": "errors.training_steps",
}
# cublas_guard_ext.training and cublas_guard_ext.capsule are the folders now; their
# __init__ exports the names the modules of that path had.

# _native's flat modules (old path under cublas_guard_ext._native.) -> their folder now.
NATIVE_MOVED = {
    **dict.fromkeys(
        ("build", "core_build", "unity_build", "ninja_build", "toolkit", "cxx_flags", "sources"), "building"
    ),
    **dict.fromkeys(("loader", "codes"), "loading"),
    **dict.fromkeys(("stable_core", "stable_core_grouped"), "core_twins"),
    **dict.fromkeys(("facts", "libraries", "known_builds"), "machine"),
}

# Old paths whose attribute on the package is a public name, not the module.
PUBLIC_NAMES = {"watch"}

_PACKAGE = __name__.rpartition(".")[0]


_NATIVE = f"{_PACKAGE}._native"


def _native_target(fullname: str) -> str | None:
    """The moved module an old ``_native`` path names, or None."""
    parent, _, leaf = fullname.rpartition(".")
    return f"{_NATIVE}.{NATIVE_MOVED[leaf]}.{leaf}" if parent == _NATIVE and leaf in NATIVE_MOVED else None


class _NativeAliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old ``_native`` path as the module that holds its code now (the same object)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 (the finder protocol)
        if _native_target(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):  # noqa: ANN001
        module = importlib.import_module(_native_target(spec.name))
        spec.loader_state = module.__spec__  # the import system sets __spec__ to the old path's
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The moved module ran when it was imported under its own name; it keeps its own spec
        # (its relative imports and importlib.reload read it).
        module.__spec__ = module.__spec__.loader_state


def _native_attribute(name: str) -> types.ModuleType:
    """``_native.<old name>``, read as an attribute: the moved module, imported on first use."""
    if name not in NATIVE_MOVED:
        raise AttributeError(f"module {_NATIVE!r} has no attribute {name!r}")
    return importlib.import_module(f"{_NATIVE}.{name}")


def install() -> None:
    if not any(isinstance(finder, _NativeAliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(_NativeAliasFinder())
    importlib.import_module(_NATIVE).__getattr__ = _native_attribute
    package = sys.modules[_PACKAGE]
    for old, new in MOVED.items():
        module = importlib.import_module(f"{_PACKAGE}.{new}")
        sys.modules[f"{_PACKAGE}.{old}"] = module
        if old not in PUBLIC_NAMES:
            parent, _, leaf = old.rpartition(".")  # errors.runtime: an attribute of errors
            setattr(sys.modules[f"{_PACKAGE}.{parent}"] if parent else package, leaf, module)


install()
