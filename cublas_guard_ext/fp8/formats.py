"""The float8 formats' numbers, torchao's recipes by name, the torchao floor, and the thresholds.

Measured on torch 2.13 (docs/fp8.md): ``float8_e4m3fn`` holds +/-448, its smallest subnormal is
2**-9 and a value at or below half of it (2**-10) rounds to 0; it has no Inf, so an eager cast
saturates +Inf to 448 (torch >= 2.12). ``float8_e5m2`` holds +/-57344, smallest subnormal 2**-16,
and keeps Inf. The ``fnuz`` variants (ROCm) are listed with their own numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

TORCHAO_FLOOR = "0.18.0"  # the oldest torchao whose Float8Linear the guard was checked against
STRICT_ENV = "CUBLAS_GUARD_FP8_STRICT"


@dataclass(frozen=True)
class Format:
    name: str
    max: float  # the largest finite value: what saturates
    tiny: float  # the smallest subnormal; |x * scale| <= tiny / 2 becomes 0
    has_inf: bool
    top_ulp: float  # the spacing just below max: |x * scale| above max + top_ulp / 2 is clipped

    @property
    def clipped_above(self) -> float:
        """Scaled values above this are clipped to max; below, they round to max anyway (an amax
        scaled in float32 lands a rounding error above max: that is not saturation)."""
        return self.max + self.top_ulp / 2


def _formats() -> dict[torch.dtype, Format]:
    table = {}
    for name, tiny_exp, has_inf, top_ulp in (
        ("float8_e4m3fn", -9, False, 32.0),  # 416, 448
        ("float8_e5m2", -16, True, 8192.0),  # 49152, 57344
        ("float8_e4m3fnuz", -10, False, 16.0),  # 224, 240
        ("float8_e5m2fnuz", -17, False, 8192.0),
    ):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            largest = float(torch.finfo(dtype).max)
            table[dtype] = Format(name.removeprefix("float8_"), largest, 2.0**tiny_exp, has_inf, top_ulp)
    return table


FORMATS = _formats()


def format_of(dtype: torch.dtype) -> Format | None:
    return FORMATS.get(dtype)


@dataclass
class Thresholds:
    """Above these fractions an operand's saturation / flush to zero is a Fp8RangeWarning (an
    Fp8RangeError when ``strict``). Chosen from clean FP8 training of MiniLM and GPT-2 on the CPU
    (benchmarks/RESULTS.md, "FP8"): no value saturated; the largest flushed fraction, 1.3% (MiniLM,
    rowwise, grad_weight's grad_output), is a quarter of the flush threshold."""

    saturate: float = 1e-3
    flush: float = 0.05
    strict: bool = os.environ.get(STRICT_ENV, "0").strip() not in ("", "0")


THRESHOLDS = Thresholds()


def set_thresholds(
    *, saturate: float | None = None, flush: float | None = None, strict: bool | None = None
) -> Thresholds:
    """Change the process's FP8 range thresholds (fractions of an operand's values) and strictness;
    returns them."""
    for name, value in (("saturate", saturate), ("flush", flush)):
        if value is not None:
            if not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"cublas_guard_ext.fp8: {name} must be a fraction in [0, 1], got {value!r}")
            setattr(THRESHOLDS, name, float(value))
    if strict is not None:
        THRESHOLDS.strict = bool(strict)
    return THRESHOLDS
