"""Run a function right after a module of another package is imported, whenever the process
imports it: how ``run`` and ``replace_linear`` reach classes of transformers and torchao that a
script may import only later (the experts' integration, torchao's Float8Linear), without
importing those packages themselves.

The finder sits first on ``sys.meta_path`` until the module is found, then leaves; it wraps only
that module's loader, so every other import is untouched. It imports nothing of the package.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then()`` right after ``module`` has been executed (once, then leaves)."""

    def __init__(self, module: str, then: Callable[[], object]) -> None:
        self.module = module
        self.then = then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.module:
            return None
        self.remove()  # before find_spec below, which would otherwise ask this finder again
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            sys.modules.setdefault(name, module)
            self.then()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  (this spec's loader)
        return spec

    def install(self) -> None:
        """Wait for the module (first on sys.meta_path); a no-op while already waiting."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
