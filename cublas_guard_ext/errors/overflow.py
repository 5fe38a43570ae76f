"""The overflow story: a value past the largest one its dtype holds.

float16 holds at most 65504; bfloat16 (like float32) about 3.4e38; the fp8 formats 448 (e4m3fn)
and 57344 (e5m2). An op whose result passes that from finite inputs writes +/-Inf, never NaN
(NaN comes one op later, from Inf - Inf or 0 * Inf). So +/-Inf alone in a half-precision or fp8
tensor is the mark of an overflow, the commonest source of Inf in half-precision training and
inference. This module tells that story from an error's fields:

* watch's finding at the op (``NonFiniteOutputError``): the dtype's largest value, the inputs'
  absolute maxima and, for a GEMM, how far its outputs can reach. Each output sums K products,
  so ``|output| <= K * max|a| * max|b| + max|bias|``; the Inf says that one output passed the
  range, the bound says by at most how much. (A bound, not the value: the value is gone, and
  recomputing a row on the error path would need the operands, which a finding judged by its
  consequence no longer has.) A GEMM whose bound stays inside the range is not called an
  overflow: something else made the Inf.
* the next guarded layer's refusal of such a tensor (``NonFiniteInputError``): the refused
  tensor's largest finite value, and the guarded layer that ran before it on this thread, with
  the input magnitude at which that layer's GEMM passes the range,
  ``(max - max|bias|) / (in_features * max|weight|)``.

Then what to try, in order: a wider dtype for that layer (bfloat16 or float32), autocast, loss
scaling (for gradients: it does nothing for a forward overflow, so it is offered in backward
only), a smaller learning rate. Not ``allow=``: an overflow is a bug to fix, not a value to
let through.

Pure functions of plain fields (no torch import), like magnitudes.py.
"""

from __future__ import annotations

import math
from typing import Any

from .magnitudes import format_max, format_number

# Formats narrow enough for an overflow to be the likely story (float32/float64 overflow is
# rare, and "use a wider dtype" would not apply).
_NARROW = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")

# Ops whose +/-Inf from finite inputs is not an overflow (a pole: log(0), 1/0, ...): their own
# hints (format._PRODUCER_HINTS) stay.
_POLES = frozenset(
    "log log2 log10 log1p div divide true_divide reciprocal rsqrt sqrt acos asin atanh xlogy "
    "logit erfinv digamma polygamma lgamma mvlgamma special_xlog1py special_logit".split()
)

# GEMMs by op base name: (a, b, bias, how K is read). The names are the op's schema argument
# names, as watch reports them in input_names. K: "last" = a's last dim; "rows" = the product of
# a's dims but the last (a weight gradient sums over the batch); "first_last" = a's first dim
# times its last (addbmm sums over the batch too).
_GEMMS: dict[str, tuple[str, str, str | None, str]] = {
    "linear": ("input", "weight", "bias", "last"),
    "linear_grad_input": ("grad_output", "weight", None, "last"),
    "linear_grad_weight": ("grad_output", "x", None, "rows"),
    "addmm": ("mat1", "mat2", "self", "last"),
    "mm": ("self", "mat2", None, "last"),
    "bmm": ("self", "mat2", None, "last"),
    "baddbmm": ("batch1", "batch2", "self", "last"),
    "addbmm": ("batch1", "batch2", "self", "first_last"),
    "matmul": ("self", "other", None, "last"),
    "mv": ("self", "vec", None, "last"),
    "addmv": ("mat", "vec", "self", "last"),
    "dot": ("self", "tensor", None, "last"),
    "_grouped_mm": ("self", "mat2", None, "last"),
    "grouped_linear": ("x", "weight", "bias", "last"),
    "grouped_linear_grad_input": ("grad_output", "weight", None, "last"),
    "grouped_linear_grad_weight": ("grad_output", "x", None, "rows"),
}
# The guarded linear names its input "x" (cublas_guard.linear's schema).
_ALIASES = {"input": ("input", "x")}


def _op_base(op: Any) -> str:
    parts = str(op or "").split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def narrow_format(fields: dict[str, Any]) -> tuple[str, float] | None:
    """(label, largest value) when ``fields`` describe +/-Inf alone (no NaN) in a float16,
    bfloat16 or fp8 tensor: the mark of an overflow. None otherwise."""
    fmt = format_max(fields.get("dtype"))
    if fmt is None or fmt[0] not in _NARROW:
        return None
    nan, posinf, neginf = (fields.get(k) for k in ("nan_count", "posinf_count", "neginf_count"))
    if nan != 0 or not isinstance(posinf, int) or not isinstance(neginf, int) or posinf + neginf <= 0:
        return None
    return fmt


def _by_name(fields: dict[str, Any], name: str) -> tuple[str, Any, Any]:
    """(name as the op calls it, shape, absmax) of the op's input called ``name`` (or one of its
    aliases)."""
    names = list(fields.get("input_names") or [])
    shapes = list(fields.get("input_shapes") or [])
    absmax = list(fields.get("input_absmax") or [])
    for alias in _ALIASES.get(name, (name,)):
        if alias in names:
            i = names.index(alias)
            return alias, shapes[i] if i < len(shapes) else None, absmax[i] if i < len(absmax) else None
    return name, None, None


def gemm_bound(fields: dict[str, Any]) -> dict[str, Any] | None:
    """For a GEMM op with known operand magnitudes: K, max|a|, max|b|, max|bias| (0 when there
    is none) and the bound K * max|a| * max|b| + max|bias|. None for any other op."""
    spec = _GEMMS.get(_op_base(fields.get("op")))
    if spec is None:
        return None
    a_name, a_shape, a_max = _by_name(fields, spec[0])
    b_name, _, b_max = _by_name(fields, spec[1])
    bias_max = _by_name(fields, spec[2])[2] if spec[2] else None
    k_rule = spec[3]
    if not a_shape or a_max is None or b_max is None:
        return None
    if k_rule == "rows":
        k = math.prod(int(d) for d in a_shape[:-1])
    elif k_rule == "first_last":
        k = int(a_shape[0]) * int(a_shape[-1])
    else:
        k = int(a_shape[-1])
    bias = float(bias_max) if bias_max is not None else 0.0
    return {
        "k": k,
        "a": a_name,
        "b": b_name,
        "a_max": float(a_max),
        "b_max": float(b_max),
        "bias_max": bias,
        "bound": k * float(a_max) * float(b_max) + bias,
    }


def finding_overflow(fields: dict[str, Any]) -> dict[str, Any] | None:
    """The fields an overflow adds to watch's finding (``overflow``, ``dtype_max``,
    ``overflow_bound``), or None when the story does not hold: not +/-Inf alone in a narrow
    format, a pole (log, 1/x) rather than an overflow, or a GEMM whose bound stays in range."""
    fmt = narrow_format(fields)
    if fmt is None or fields.get("op") is None or _op_base(fields.get("op")) in _POLES:
        return None
    if fields.get("past_groups"):  # rows no group owns: uninitialized memory, not an overflow
        return None
    gemm = gemm_bound(fields)
    if gemm is not None and gemm["bound"] <= fmt[1]:
        return None
    return {"overflow": True, "dtype_max": fmt[1], "overflow_bound": gemm["bound"] if gemm else None}


def _n(value: float) -> str:
    return format_number(float(value))


def finding_lines(fields: dict[str, Any]) -> list[str]:
    """The overflow line of watch's finding (empty when ``overflow`` is not set)."""
    if not fields.get("overflow"):
        return []
    label, largest = format_max(fields.get("dtype")) or ("?", float("nan"))
    gemm = gemm_bound(fields)
    if gemm is not None:
        return [
            f"overflow: {label}'s largest value is {_n(largest)}; each output of this GEMM sums "
            f"K = {gemm['k']} products of {gemm['a']} and {gemm['b']}, so it can reach "
            f"{gemm['k']} x {_n(gemm['a_max'])} x {_n(gemm['b_max'])} + {_n(gemm['bias_max'])} "
            f"(max|{gemm['a']}| x max|{gemm['b']}| + max|bias|) = {_n(gemm['bound'])}: up to "
            f"{gemm['bound'] / largest:.3g}x past the range"
        ]
    base = _op_base(fields.get("op"))
    line = f"overflow: {label}'s largest value is {_n(largest)}, and this op's result passed it from finite inputs"
    if base.rstrip("_") in ("exp", "expm1", "exp2"):
        limit = math.log2(largest) if base.startswith("exp2") else math.log(largest)
        line += f" ({base.rstrip('_')}(v) passes it for v > {limit:.4g})"
    return [line]


def refusal_lines(fields: dict[str, Any]) -> list[str]:
    """The overflow lines of a guarded layer's refusal of an input with +/-Inf alone (empty when
    the dtype is not a narrow format)."""
    fmt = narrow_format(fields)
    if fmt is None:
        return []
    label, largest = fmt
    line = f"overflow: a value past {label}'s largest, {_n(largest)}, becomes +/-Inf (never NaN)"
    finite, role = fields.get("finite_absmax"), fields.get("role", "input")
    bad = (fields.get("posinf_count") or 0) + (fields.get("neginf_count") or 0)
    if fields.get("numel") is not None and bad >= int(fields["numel"]):
        line += f"; none of this {role}'s values is finite"
    elif finite is not None:
        line += f"; the finite values of this {role} reach {_n(finite)} ({finite / largest:.0%} of the range)"
    lines = [line]
    if fields.get("role") != "input" or fields.get("deferred"):
        return lines
    previous = fields.get("previous_layer")
    if previous is None:
        lines.append(
            "no guarded layer ran before it on this thread: the overflow is in an op before it, "
            f"or in the data (values past {_n(largest)} cast to {label})"
        )
    elif previous == fields.get("layer"):
        lines.append(
            "the guarded layer that ran before it on this thread is this layer itself (an earlier call)"
        )
    else:
        lines.append(_previous_line(fields, label, largest))
    return lines


def _previous_line(f: dict[str, Any], label: str, largest: float) -> str:
    line = f"the guarded layer that ran before it on this thread: '{f['previous_layer']}'"
    k, w, b = f.get("previous_in_features"), f.get("previous_weight_absmax"), f.get("previous_bias_absmax")
    if k and w:
        bias = float(b or 0.0)
        threshold = (largest - bias) / (int(k) * float(w))
        line += (
            f" (in_features {k}, max|weight| {_n(w)}, max|bias| {_n(bias)}): its outputs can pass "
            f"{_n(largest)} once its input reaches {_n(threshold)} = ({_n(largest)} - {_n(bias)}) / "
            f"({k} x {_n(w)})"
        )
    return line + "; the overflow is in it or in an op between the two"


def next_steps(fields: dict[str, Any], where: str) -> list[str]:
    """What to try, in order, for an overflow at ``where`` ("module 'decoder.3'", "this op")."""
    fmt = format_max(fields.get("dtype"))
    label = fmt[0] if fmt else "float16"
    backward = fields.get("phase") == "backward" or fields.get("role") == "grad_output"
    gemm = gemm_bound(fields) is not None or fields.get("role") in ("input", "grad_output")
    later = (
        "if it began after some training: a smaller learning rate, gradient clipping "
        "(torch.nn.utils.clip_grad_norm_), weight decay: weights and activations that keep "
        "growing end past any range"
    )
    if label == "bfloat16":
        return [
            "bfloat16 already has float32's range (largest 3.39e+38): values past it mean the "
            "computation diverged, not that the dtype is too small",
            later,
            f"look for an exp or pow of large values at or before {where}",
        ]
    if label.startswith("float8"):
        return [
            f"keep {where} in bfloat16, or scale its operands into range before the cast to "
            f"{label} (a per-tensor scale from the amax history, as torchao and Transformer "
            "Engine do)",
            later,
        ]
    steps = [
        f"give {where} more range: bfloat16 has float32's range (largest 3.39e+38) at float16's "
        "size (model.to(torch.bfloat16): GPUs since Ampere, and CPUs), or float32 (for one layer: "
        "layer.float(), its input cast with x.float() and its output back with .half())",
        "or keep the weights in float32 and run under torch.autocast(device_type, "
        "dtype=torch.bfloat16)"
        + (
            " (float16 autocast keeps matmuls in float16: it would not remove this overflow)"
            if gemm
            else " (float16 autocast also helps here: it runs exp, sums, softmax, norms and losses "
            "in float32)"
        ),
    ]
    if backward:
        steps.append(
            "gradients past the range: loss scaling (torch.amp.GradScaler) skips the steps whose "
            "gradients overflow and lowers the scale; with a GradScaler already, such an Inf is how "
            "it finds its scale: it matters only if it repeats every step"
        )
    steps.append(later)
    return steps
