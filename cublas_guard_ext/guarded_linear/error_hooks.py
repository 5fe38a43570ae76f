"""What a guarded layer's error gains when the native library builds it (``errors.parse``'s
hooks, run on the error path only):

* the layer's current name (:mod:`cublas_guard_ext.guarded_linear.naming`): the model may have changed since
  its layers were named;
* for an input or gradient refused for +/-Inf alone in a float16, bfloat16 or fp8 tensor (most
  likely an overflow before the layer): the dtype, the refused tensor's largest finite value, and
  the guarded layer that ran before it on this thread, with its in_features and its weight's and
  bias's largest magnitudes (``errors/overflow.py`` tells the story from them).

What a healthy call pays: one store per guarded forward, ``LAST_RAN.label = <the layer's
label>`` in a thread-local (no tensor kept, no host sync; benchmarks/RESULTS.md has the figure).
Everything else is measured here, after a refusal, from the operands the native library hands
over with the report.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..errors import GuardError, NonFiniteInputError
from ..errors.overflow import narrow_format
from ..errors.parse import add_native_error_hook
from .naming import current_name, find_layer, layers_named

__all__ = ["LAST_RAN"]

# The label of the guarded layer whose forward returned last on this thread (nn.py sets it).
LAST_RAN = threading.local()


def _absmax(t: torch.Tensor | None, finite_only: bool = False) -> float | None:
    """The largest magnitude of ``t`` (of its finite values), or None (empty, not floating)."""
    if t is None or not t.is_floating_point() or t.numel() == 0 or t.device.type == "meta":
        return None
    with torch.no_grad():
        values = t.detach().abs()
        if finite_only:
            values = values.nan_to_num(nan=0.0, posinf=0.0)
        return float(values.max().float().item())


def _layer_facts(layer: torch.nn.Module) -> dict[str, Any]:
    """in_features and the weight's and bias's largest magnitudes of a guarded layer."""
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return {}
    in_features = _features(layer)[0]
    return {
        "previous_in_features": int(in_features) if in_features is not None else None,
        "previous_weight_absmax": _absmax(weight),
        "previous_bias_absmax": _absmax(bias) if isinstance(bias, torch.Tensor) else 0.0,
    }


def _features(layer: torch.nn.Module) -> tuple[int | None, int | None]:
    """(in_features, out_features) of a SafeLinear or a SafeConv1D (nx, nf)."""
    return getattr(layer, "in_features", getattr(layer, "nx", None)), getattr(
        layer, "out_features", getattr(layer, "nf", None)
    )


def _parameter_dtype(f: dict[str, Any]) -> str | None:
    """The dtype of the layer a deferred report names, from its weight: the layer running on
    the stack, else the known layers with that label and the reported tensor's width, when
    they agree (a label like '2' is common to many models)."""
    label = str(f.get("layer"))
    found = find_layer(label)
    candidates = [found] if found is not None else layers_named(label)
    shape = f.get("shape")
    width = int(shape[-1]) if shape else None
    dtypes = set()
    for layer in candidates:
        weight = getattr(layer, "weight", None)
        in_features, out_features = _features(layer)
        wanted = out_features if f.get("role") == "grad_output" else in_features
        if isinstance(weight, torch.Tensor) and (width is None or wanted == width):
            dtypes.add(str(weight.dtype))
    return dtypes.pop() if len(dtypes) == 1 else None


def _overflow_facts(
    err: NonFiniteInputError,
    native: dict[str, Any] | None,
    previous: tuple[str, torch.nn.Module | None] | None,
) -> dict[str, Any]:
    f = err.fields
    role = f.get("role", "input")
    if role not in ("input", "grad_output") or f.get("nan_count") != 0:
        return {}
    new: dict[str, Any] = {}
    if f.get("dtype") is None and f.get("layer"):
        # a deferred (async) report keeps no dtype; a half-precision layer's input is too
        # (strict dtypes: input and weight match)
        dtype = _parameter_dtype(f)
        if dtype is None:
            return {}
        new["dtype"] = dtype
    if narrow_format({**f, **new}) is None:
        return new
    if f.get("deferred"):  # the operands and the record are of the call running now, not its
        return new
    operand = (native or {}).get("operands", {}).get(role)
    if isinstance(operand, torch.Tensor):
        new["finite_absmax"] = _absmax(operand, finite_only=True)
    if role == "input":
        new["previous_layer"] = None
        if previous is not None:
            label, layer = previous
            if layer is not None and layer.guard_label == label:
                current_name(label)  # (unless the refusing layer's renaming did it already)
            new["previous_layer"] = layer.guard_label if layer is not None else label
            if label != f.get("layer") and layer is not None:
                new.update(_layer_facts(layer))
    return new


def _on_native_error(err: GuardError, native: dict[str, Any] | None) -> GuardError | None:
    new: dict[str, Any] = {}
    previous = None
    if isinstance(err, NonFiniteInputError):
        label = getattr(LAST_RAN, "label", None)
        if label is not None:  # found by its label before any renaming below
            previous = (label, find_layer(label))
    label = err.fields.get("layer")
    if label:
        renamed = current_name(str(label))
        if renamed is not None:
            new["layer"] = renamed
    if isinstance(err, NonFiniteInputError):
        new.update(_overflow_facts(err, native, previous))
    if not new:
        return None
    rebuilt = type(err)(**{**err.fields, **new})
    rebuilt.capsule, rebuilt.capsule_note = err.capsule, err.capsule_note
    return rebuilt


add_native_error_hook(_on_native_error)
