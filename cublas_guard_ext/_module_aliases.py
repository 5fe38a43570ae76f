"""The module paths of the flat layout (every module beside ``__init__``), still importable.

A model saved with ``torch.save(model)`` names the class's module (``cublas_guard_ext.nn``),
and users' code and docs name the others: each old path is the module that now holds that
code, the same object (``sys.modules``), so pickles load, ``import cublas_guard_ext.nn``
works and a monkeypatch through an old path changes the code that runs.

``cublas_guard_ext.watch`` stays the public class: ``import cublas_guard_ext.watch`` still
loads, but the attribute (and ``import cublas_guard_ext.watch as w``) is the class; the
module is ``cublas_guard_ext.watching.session``, a name nothing hides.
"""

from __future__ import annotations

import importlib
import sys

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

# Old paths whose attribute on the package is a public name, not the module.
PUBLIC_NAMES = {"watch"}

_PACKAGE = __name__.rpartition(".")[0]


def install() -> None:
    package = sys.modules[_PACKAGE]
    for old, new in MOVED.items():
        module = importlib.import_module(f"{_PACKAGE}.{new}")
        sys.modules[f"{_PACKAGE}.{old}"] = module
        if old not in PUBLIC_NAMES:
            parent, _, leaf = old.rpartition(".")  # errors.runtime: an attribute of errors
            setattr(sys.modules[f"{_PACKAGE}.{parent}"] if parent else package, leaf, module)


install()
