"""FP8 GEMMs under the guard (docs/fp8.md).

* torchao's ``Float8Linear``: :func:`guard_float8` (what :func:`cublas_guard_ext.replace_linear`
  calls) retypes each into ``GuardedFloat8Linear`` (fp8/linear.py), FP8 kept, bitwise;
  :func:`restore_float8` gives ``Float8Linear`` back (``restore_linear`` calls it);
* direct scaled GEMMs and casts to float8: :func:`checked_fp8` (a context manager; ``run`` keeps it
  on) checks ``torch._scaled_mm``, ``F.scaled_mm``, ``torch._scaled_grouped_mm`` and every
  ``Tensor.to`` a float8 dtype (fp8/direct.py);
* :func:`check` reads the pending async checks; :func:`set_thresholds` the range thresholds.

torchao is never imported here: a model can hold a ``Float8Linear`` only once
``torchao.float8.float8_linear`` is loaded, so without it every function is a no-op.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from torch import nn

from ..errors.fp8 import FLOAT8_LEFT_REASON, TORCHAO_TOO_OLD, TORCHAO_TOO_OLD_REASON
from .direct import checked_fp8
from .formats import FORMATS, THRESHOLDS, TORCHAO_FLOOR, Thresholds, format_of, set_thresholds

__all__ = [
    "guard_float8",
    "restore_float8",
    "is_guarded_float8",
    "float8_left_reason",
    "check",
    "checked_fp8",
    "set_thresholds",
    "Thresholds",
    "THRESHOLDS",
    "FORMATS",
    "TORCHAO_FLOOR",
    "format_of",
]

_TORCHAO_LINEAR = "torchao.float8.float8_linear"


def _version_tuple(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def _linear_module() -> Any:
    """fp8/linear.py if torchao's float8 Linear is loaded and new enough, else None."""
    if _TORCHAO_LINEAR not in sys.modules:
        return None
    import torchao

    if _version_tuple(getattr(torchao, "__version__", "0")) < _version_tuple(TORCHAO_FLOOR):
        return None
    from . import linear

    return linear


def _is_float8_linear(module: Any) -> bool:
    ao = sys.modules.get(_TORCHAO_LINEAR)
    return ao is not None and type(module) is ao.Float8Linear


def is_guarded_float8(module: Any) -> bool:
    """A Float8Linear that :func:`guard_float8` guarded."""
    return (
        type(module).__name__ == "GuardedFloat8Linear"
        and _linear_module() is not None
        and (_linear_module().is_guarded(module))
    )


def float8_left_reason(module: Any) -> str | None:
    """Why ``module`` (a torchao Float8Linear left as it is) is not guarded; None otherwise."""
    if not _is_float8_linear(module):
        return None
    import torchao

    version = getattr(torchao, "__version__", "?")
    if _linear_module() is None:
        return TORCHAO_TOO_OLD_REASON.format(version=version, floor=TORCHAO_FLOOR)
    return FLOAT8_LEFT_REASON.format(floor=TORCHAO_FLOOR)


def guard_float8(model: nn.Module, names: set[str] | None = None, mode: str | None = None) -> list[str]:
    """Guard ``model``'s torchao Float8Linear layers (all, or those named in ``names``) in place;
    return the qualified names guarded. A torchao older than :data:`TORCHAO_FLOOR` leaves them
    as they are, with a warning; without torchao loaded there are none."""
    found = [
        (name, module)
        for name, module in model.named_modules()
        if _is_float8_linear(module) and (names is None or name in names)
    ]
    if not found:
        return []
    linear = _linear_module()
    if linear is None:
        import torchao

        warnings.warn(
            TORCHAO_TOO_OLD.format(version=torchao.__version__, floor=TORCHAO_FLOOR, count=len(found)),
            UserWarning,
            stacklevel=3,
        )
        return []
    for name, module in found:
        linear.guard(module, name or type(module).__name__, mode)
    return [name for name, _ in found]


def restore_float8(model: nn.Module) -> nn.Module:
    """Every guarded Float8Linear of ``model`` back to torchao's ``Float8Linear``, in place
    (pending async checks are read first)."""
    linear = _linear_module()
    if linear is not None:
        for module in model.modules():
            if linear.is_guarded(module):
                linear.unguard(module)
    return model


def check() -> None:
    """Raise the first failure the async checks of the guarded Float8Linear layers found (a host
    read per pending check; the direct calls' checks are read at once)."""
    linear = _linear_module()
    if linear is not None:
        linear.check_layers()
