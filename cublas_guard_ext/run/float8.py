"""FP8 under ``python -m cublas_guard_ext run``: every torchao ``Float8Linear`` guarded on its first
call (named like the run's Linear layers, FP8 kept: fp8/linear.py), and the direct FP8 calls and
float8 casts checked (fp8/direct.py).

``Float8Linear.forward`` is replaced on the class once torchao's float8 Linear is loaded (now, or
when the script imports it: an import hook like the experts'); the first call retypes that layer
in place into ``GuardedFloat8Linear`` and goes on there. A torchao older than the floor the guard
supports keeps its layers as they are.
"""

from __future__ import annotations

import sys
from typing import Any

from .. import fp8
from .._import_hooks import AfterImport
from ..fp8 import direct
from . import linear

_MODULE = "torchao.float8.float8_linear"
_original: dict[str, Any] = {}


def _patch() -> bool:
    """Replace Float8Linear.forward if torchao's float8 Linear is loaded; whether it is."""
    module = sys.modules.get(_MODULE)
    if module is None or not hasattr(module, "Float8Linear"):
        return False
    if _original or not _installed["on"]:
        return True
    cls = module.Float8Linear
    original = cls.forward

    def forward(self: Any, input: Any) -> Any:  # noqa: A002 (nn.Linear's name)
        if type(self) is cls and fp8.float8_left_reason(self) is not None:
            name = self.__dict__.get(linear.NAME_ATTR) or linear._name_on_first_call(self)
            if fp8.guard_float8(self, None, None):  # the layer itself: guarded in place
                self.guard_name = name
                return self.forward(input)
        return original(self, input)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    _original["forward"] = (cls, original)
    cls.forward = forward
    return True


# Patches Float8Linear right after torchao's float8_linear module ran (now, or when the script
# imports it), then leaves sys.meta_path.
_FINDER = AfterImport(_MODULE, lambda: _patch())
_installed = {"on": False}


def install() -> None:
    if _installed["on"]:
        return
    _installed["on"] = True
    direct.install()
    if not _patch():
        _FINDER.install()


def uninstall() -> None:
    if not _installed["on"]:
        return
    _installed["on"] = False
    _FINDER.remove()
    direct.uninstall()
    patched = _original.pop("forward", None)
    if patched is not None:
        cls, original = patched
        cls.forward = original
