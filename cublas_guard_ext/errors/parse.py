"""From a native error's payload line to the typed exception, and the failure capsule
of the cuBLAS-side ones (cublas_guard_ext.capsule)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from .base import GuardError
from .cuda_runtime import (
    CublasError,
    CublasOutOfMemoryError,
    CudaLaunchError,
    GraphCaptureError,
    OutOfMemoryError,
    PendingCudaError,
)
from .experts import GroupOffsetsError
from .format import _dtype
from .inputs import (
    DeviceMismatchError,
    DTypeError,
    NonFiniteInputError,
    ShapeMismatchError,
    SizeLimitError,
)
from .watch_findings import NonFiniteEntryError, NonFiniteFromNowhereError, NonFiniteOutputError

PAYLOAD_MARKER = "[cublas_guard_ext payload] "
_PAYLOAD_RE = re.compile(re.escape(PAYLOAD_MARKER) + r"(\{.*\})\s*$", re.S)


_BY_KIND: dict[str, type[GuardError]] = {
    cls.kind: cls
    for cls in (
        DTypeError,
        ShapeMismatchError,
        DeviceMismatchError,
        NonFiniteInputError,
        NonFiniteOutputError,
        NonFiniteEntryError,
        NonFiniteFromNowhereError,
        SizeLimitError,
        CublasError,
        PendingCudaError,
        CudaLaunchError,
        GraphCaptureError,
        OutOfMemoryError,
        CublasOutOfMemoryError,
        GroupOffsetsError,
    )
}


def parse_payload(message: str) -> dict[str, Any] | None:
    """The structured fields in a native error message, or None."""
    match = _PAYLOAD_RE.search(message)
    if match is None:
        return None
    try:
        payload = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    return payload if isinstance(payload, dict) else None


def from_payload(payload: dict[str, Any]) -> GuardError:
    """Build the typed error for a payload dict (``kind`` selects the class)."""
    fields = dict(payload)
    kind = fields.pop("kind", "guard")
    for key, value in fields.items():  # c10's dtype names -> torch's ("Double" -> "torch.float64")
        if key == "dtype" or key.endswith("_dtype"):
            fields[key] = _dtype(value)
    if kind == "cublas" and (
        fields.get("status") == 3 or (fields.get("status") == 1 and fields.get("stage") == "handle")
    ):
        kind = "cublas_out_of_memory"  # ALLOC_FAILED, or NOT_INITIALIZED creating the handle
    cls = _BY_KIND.get(kind, GuardError)
    return cls(**fields)


def from_native(exc: BaseException) -> GuardError | None:
    """The typed error for a native exception, or None if it is not one of ours."""
    payload = parse_payload(str(exc))
    return None if payload is None else from_payload(payload)


# The errors a failure capsule is written for: the cuBLAS side of a call.
_CAPTURED = (CublasError, PendingCudaError, CudaLaunchError)


# Writing the capsule is capsule/contents.py's (capture), which hands it in when it loads:
# errors imports nothing of the package. Until then (never, once the package has loaded)
# no capsule is written, as with capture off.
_capsule_writer: list[Callable[[BaseException, dict[str, Any] | None], tuple[str | None, str | None]]] = []


def write_capsules_with(
    writer: Callable[[BaseException, dict[str, Any] | None], tuple[str | None, str | None]],
) -> None:
    """Called by capsule/contents.py: ``writer(err, native)`` writes a capsule, returns (path, note)."""
    _capsule_writer[:] = [writer]


def attach_capsule(err: GuardError, native: dict[str, Any] | None = None) -> GuardError:
    """Writes the failure capsule of a cuBLAS-side error raised by a guarded call or watch.

    Sets ``err.capsule`` (the path, or None) and puts the path, or why there is none, in
    the message. Never raises and never changes anything else about the error.
    """
    if not isinstance(err, _CAPTURED) or not _capsule_writer:
        return err
    path, note = _capsule_writer[0](err, native)
    if path is None and note is None:  # capture is off
        return err
    err.capsule, err.capsule_note = path, note
    err.args = (err._format(),)
    return err


# What the layers above add to a native error when it is built, in order: each hook takes the
# error and the native context and returns a replacement (new fields, the same class) or None.
# guarded_linear/error_hooks.py adds the layer's current name and the facts of an overflow;
# the errors package cannot import it (it sits above), so it registers itself here.
NativeErrorHook = Callable[[GuardError, "dict[str, Any] | None"], "GuardError | None"]
_HOOKS: list[NativeErrorHook] = []


def add_native_error_hook(hook: NativeErrorHook) -> None:
    """Run ``hook`` on every error the native library raises, when it is built (error path only)."""
    if hook not in _HOOKS:
        _HOOKS.append(hook)


def _with_hooks(err: GuardError, native: dict[str, Any] | None) -> GuardError:
    for hook in _HOOKS:
        try:
            better = hook(err, native)
        except Exception:  # the error path must not fail: the error stays as it was
            better = None
        if better is not None:
            err = better
    return err


def _typed_from_native_message(message: str, native: dict[str, Any] | None = None) -> GuardError | None:
    """Called by the native library (python_errors.cpp) to build the exception it raises.

    ``native``: the tensors of the failing call (the GEMM's buffers, the guarded call's
    operands), its phase and number, for the failure capsule.
    """
    payload = parse_payload(message)
    if payload is None:
        return None
    return attach_capsule(_with_hooks(from_payload(payload), native), native)
