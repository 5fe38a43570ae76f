"""What a guarded layer's error gains when the native library builds it (``errors.parse``'s
hooks, run on the error path only): the layer's current name (:mod:`cublas_guard_ext.naming`),
since the model may have changed since its layers were named.
"""

from __future__ import annotations

from typing import Any

from .errors import GuardError
from .errors.parse import add_native_error_hook
from .naming import current_name

__all__: list[str] = []


def _on_native_error(err: GuardError, native: dict[str, Any] | None) -> GuardError | None:
    label = err.fields.get("layer")
    renamed = current_name(str(label)) if label else None
    if renamed is None:
        return None
    rebuilt = type(err)(**{**err.fields, "layer": renamed})
    rebuilt.capsule, rebuilt.capsule_note = err.capsule, err.capsule_note
    return rebuilt


add_native_error_hook(_on_native_error)
