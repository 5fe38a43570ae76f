"""The magnitudes that explain a non-finite value: one source for every message and report.

A NaN or Inf is often an overflow: a product or sum of finite values beyond the largest
value the dtype holds (65504 for float16). Saying so, with the inputs' absolute maxima,
turns "the op named above made a NaN" into a cause. watch's findings, TrainingGuard's
divergence message and the incident report of ``python -m cublas_guard_ext run`` all
write these lines from here, from plain numbers (no torch import: the errors layer stays
torch-free).

Field names (the same on every error and in every JSON report):

* ``nan_count``, ``posinf_count``, ``neginf_count``, ``zero_count``: counts at the op;
* ``input_absmax``: the absolute maximum of each floating input's finite values, in
  argument order (``None`` where unknown or not floating);
* ``dtype``: the output's dtype, in c10's name (``Half``) or torch's (``torch.float16``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# The largest finite value of each floating format, by every name a field may carry.
_FORMAT_MAX: dict[str, tuple[str, float]] = {}
for _names, _label, _max in (
    (("Half", "torch.float16", "float16", "half"), "float16", 65504.0),
    (("BFloat16", "torch.bfloat16", "bfloat16"), "bfloat16", 3.3895313892515355e38),
    (("Float", "torch.float32", "float32", "float"), "float32", 3.4028234663852886e38),
    (("Double", "torch.float64", "float64", "double"), "float64", 1.7976931348623157e308),
    (("Float8_e4m3fn", "torch.float8_e4m3fn", "float8_e4m3fn"), "float8_e4m3fn", 448.0),
    (("Float8_e5m2", "torch.float8_e5m2", "float8_e5m2"), "float8_e5m2", 57344.0),
):
    for _name in _names:
        _FORMAT_MAX[_name] = (_label, _max)

# An input this close to the format's largest value (or beyond the square root of it, for a
# product or a sum of many terms) is a likely overflow: the note says so.
_NEAR_FRACTION = 0.5


def format_max(dtype: Any) -> tuple[str, float] | None:
    """(label, largest finite value) of a floating dtype given by any of its names."""
    return _FORMAT_MAX.get(str(dtype))


def _number(value: float) -> str:
    if value == 0 or (1e-3 <= abs(value) < 1e6):
        return f"{value:.6g}"
    return f"{value:.3e}"


def range_note(dtype: Any, absmax: float | None, *, is_product: bool = False) -> str | None:
    """One sentence when ``absmax`` explains an overflow in ``dtype``, else None.

    ``absmax`` beyond the largest value: "exceeds the float16 range 65504"; within half of it,
    or (``is_product``: a matmul, a product, a square) beyond its square root: "is near ...".
    """
    fmt = format_max(dtype)
    if fmt is None or absmax is None or not math.isfinite(absmax):
        return None
    label, largest = fmt
    if absmax > largest:
        return f"{_number(absmax)} exceeds the {label} range {_number(largest)}"
    if absmax >= _NEAR_FRACTION * largest:
        return f"{_number(absmax)} is near the {label} limit {_number(largest)}: a sum or product overflows"
    if is_product and absmax >= math.sqrt(largest):
        return (
            f"{_number(absmax)} squared exceeds the {label} range {_number(largest)}: "
            "a product of such values overflows"
        )
    return None


def magnitude_line(
    input_absmax: Sequence[float | None] | None, dtype: Any, *, is_product: bool = False
) -> str | None:
    """'inputs' absolute maxima: 1.2e+05, 3 (exceeds the float16 range 65504)', or None."""
    if not input_absmax:
        return None
    known = [v for v in input_absmax if v is not None]
    if not known:
        return None
    text = "inputs' absolute maxima: " + ", ".join("?" if v is None else _number(v) for v in input_absmax)
    note = range_note(dtype, max(known), is_product=is_product)
    return f"{text} ({note})" if note else text


def counts_line(f: dict[str, Any]) -> str | None:
    """'NaN 3, +Inf 1, -Inf 0, zeros 12' from an error's or report's count fields."""
    keys = (("nan_count", "NaN"), ("posinf_count", "+Inf"), ("neginf_count", "-Inf"), ("zero_count", "zeros"))
    if all(f.get(k) is None for k, _ in keys):
        return None
    return ", ".join(f"{label} {f[k]}" for k, label in keys if f.get(k) is not None)


def format_number(value: float) -> str:
    """A magnitude as the lines above write it: 0.5213, 65504, 1.600e+10, nan, inf."""
    if not math.isfinite(value):
        return str(value)
    return _number(value)
