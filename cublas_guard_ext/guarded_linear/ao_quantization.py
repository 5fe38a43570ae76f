"""SafeLinear under torch.ao's eager-mode quantization: told once, not skipped in silence.

torch.ao's passes (``quantize_dynamic``, ``prepare``/``convert``, ``prepare_qat``, ``quantize``)
first give every module a ``qconfig`` (``propagate_qconfig_``), then swap the modules whose exact
type is in their mapping; the quantized Linear's ``from_float`` refuses any other type. A
SafeLinear's type never is, so it stays float. SafeLinear's ``qconfig`` is therefore a property:
when such a pass sets it to a qconfig, or the pass asked for ``nn.Linear`` (its qconfig_dict holds
the type), one ``UserWarning`` per model quantized lists its guarded layers and points at
``restore_linear`` (errors/quantization.py). Reading and deleting ``qconfig`` behave as a plain
attribute's; a qconfig set by hand outside a pass says nothing.

Tried and not taken: making the passes quantize SafeLinear as they do ``nn.Linear``. That needs
the guarded type in torch's global mapping tables and a qconfig for it whenever the user's spec
names ``nn.Linear`` (``propagate_qconfig_`` looks the exact type up), i.e. patching torch.ao's
internals at import; and its result would be an unguarded int8 layer, exactly what
``restore_linear`` then quantize gives, without the user having chosen it. So the user is told,
once, and chooses.

The pass is recognised by its frames (``_propagate_qconfig_helper`` of
``torch.ao.quantization.quantize``), read only when a qconfig is set on a guarded layer.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from types import FrameType
from typing import Any

from torch import nn

from ..errors.quantization import quantization_left_message

__all__ = ["QCONFIG"]

_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_PASS_FRAME = "_propagate_qconfig_helper"
_PASS_MODULE = "torch.ao.quantization"


def _pass_frames() -> list[FrameType]:
    """The frames of torch.ao's qconfig propagation on this thread's stack, innermost first."""
    frame: FrameType | None = sys._getframe(2)
    found = []
    while frame is not None:
        if frame.f_code.co_name == _PASS_FRAME and str(frame.f_globals.get("__name__", "")).startswith(
            _PASS_MODULE
        ):
            found.append(frame)
        frame = frame.f_back
    return found


# Modules between the user's call and the pass: torch, this package, and the wrappers torch's
# deprecation decorator adds.
_NOT_THE_CALLER = ("torch", "cublas_guard_ext", "typing_extensions", "functools", "warnings")


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel of the first frame outside torch and this package (the line
    that called quantize_dynamic/prepare)."""
    frame, level = sys._getframe(2), 2
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if name.split(".")[0] not in _NOT_THE_CALLER:
            return level
        frame, level = frame.f_back, level + 1
    return 2


def _noticed(layer: nn.Module, value: Any) -> None:
    frames = _pass_frames()
    if not frames:
        return  # set by hand, not by a quantization pass
    outermost = frames[-1].f_locals
    root, qconfig_dict = outermost.get("module"), outermost.get("qconfig_dict") or {}
    try:
        asked = nn.Linear in qconfig_dict
    except TypeError:
        asked = False
    if (value is None and not asked) or not isinstance(root, nn.Module) or root in _WARNED:
        return
    _WARNED.add(root)
    names = [
        name or type(root).__name__
        for name, module in root.named_modules()
        if isinstance(module, nn.Linear) and hasattr(type(module), "guard_label")
    ]
    warnings.warn(quantization_left_message(names), UserWarning, stacklevel=_user_stacklevel())


def _get(self: nn.Module) -> Any:
    try:
        return self.__dict__["qconfig"]
    except KeyError:
        raise AttributeError(f"'{type(self).__name__}' object has no attribute 'qconfig'") from None


def _set(self: nn.Module, value: Any) -> None:
    self.__dict__["qconfig"] = value
    _noticed(self, value)


def _delete(self: nn.Module) -> None:
    if self.__dict__.pop("qconfig", _MISSING) is _MISSING:
        raise AttributeError("qconfig")


_MISSING = object()

# SafeLinear's `qconfig` (nn.py): a plain attribute that notices torch.ao's passes.
QCONFIG = property(_get, _set, _delete, doc="torch.ao's quantization config (see ao_quantization.py)")
