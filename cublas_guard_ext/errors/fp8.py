"""FP8 GEMMs' errors and warning: a float8 layer's or scaled GEMM's operand that cannot be cast
faithfully, a scale that is not a finite positive number, a range the format cannot hold, and the
arguments of a direct scaled GEMM that do not fit the recipe.

Where each is raised: cublas_guard_ext/fp8/ (the checks of torchao's ``Float8Linear``, of
``torch._scaled_mm`` / ``F.scaled_mm`` / ``torch._scaled_grouped_mm`` and of casts to a float8
dtype). The numbers behind the advice are in docs/fp8.md.
"""

from __future__ import annotations

from typing import Any

from .base import GuardError
from .format import _coords, _layer, _shape

# What a float8 GEMM's operand is called, per GEMM of a Linear (torchao's three).
GEMMS = ("forward", "grad_input", "grad_weight")


def _where(f: dict[str, Any]) -> str:
    """'layer 'fc1', grad_weight GEMM, operand grad_output (e5m2, rowwise)' or 'torch._scaled_mm, ...'."""
    if f.get("layer") is not None:
        text = f"layer {_layer(f.get('layer'))}"
        if f.get("gemm"):
            text += f", {f['gemm']} GEMM"
    else:
        text = str(f.get("op") or "a float8 cast")
    if f.get("operand"):
        text += f", operand {f['operand']}"
    detail = ", ".join(str(v) for v in (f.get("fp8_dtype"), f.get("recipe")) if v)
    return text + (f" ({detail})" if detail else "")


def _num(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _scale_line(f: dict[str, Any]) -> str:
    parts = []
    for key in ("amax", "scale"):
        if f.get(key) is not None:
            parts.append(f"{key} {_num(f[key])}")
    for key, name in (
        ("amax_min", "smallest row amax"),
        ("scale_min", "smallest scale"),
        ("scale_max", "largest scale"),
    ):
        if f.get(key) is not None:
            parts.append(f"{name} {_num(f[key])}")
    return ", ".join(parts)


class Fp8NonFiniteError(GuardError, ValueError):
    """NaN/+Inf/-Inf in the high-precision tensor about to be cast to float8 (a Float8Linear's
    input, weight or grad_output, or the input of a cast), or NaN codes in a float8 operand of a
    scaled GEMM: the cast would hide it (e4m3 saturates +Inf to 448) or the scale built from it
    makes the whole GEMM NaN (amax Inf -> scale 0 -> Inf*0)."""

    kind = "fp8_non_finite"

    def _headline(self) -> str:
        f = self.fields
        counts = f"{f.get('nan_count')} NaN, {f.get('posinf_count')} +Inf, {f.get('neginf_count')} -Inf"
        text = f"{_where(f)}: {counts} of {f.get('numel')} values before the float8 cast"
        if f.get("nan_codes"):
            inf = (f.get("posinf_count") or 0) + (f.get("neginf_count") or 0)
            text = f"{_where(f)}: {f.get('nan_count')} NaN and {inf} Inf codes of {f.get('numel')} in the float8 operand"
        if f.get("output"):
            text = f"{_where(f)}: {counts} of {f.get('numel')} output values, from finite float8 operands and scales"
        return text

    def _details(self) -> list[str]:
        f = self.fields
        lines = []
        if f.get("first_bad_index") is not None:
            line = f"first bad element: flat index {f['first_bad_index']}"
            coords = _coords(f["first_bad_index"], f.get("shape"))
            if coords is not None:
                line += f" = {f.get('operand') or 'x'}[{', '.join(str(c) for c in coords)}]"
            if f.get("first_bad_value") is not None:
                line += f" ({f['first_bad_value']})"
            lines.append(line)
        if f.get("shape") is not None:
            lines.append(f"operand: shape {_shape(f['shape'])} {f.get('dtype')}")
        scale = _scale_line(f)
        if scale:
            lines.append(f"scaling: {scale}")
        lines.append("what it would have done: " + self._consequence())
        return lines

    def _consequence(self) -> str:
        f = self.fields
        if f.get("output"):
            return "the product overflowed the output dtype (amax_a * amax_b * K above its largest value)"
        if f.get("nan_codes"):
            return "every output element that reads a NaN code is NaN, with no error from the GEMM"
        if f.get("op") == "cast" or f.get("layer") is None and f.get("gemm") is None:
            if "e4m3" in str(f.get("fp8_dtype")):
                return "the cast saturates +/-Inf to +/-448 (torch >= 2.12): the Inf disappears, training goes on"
            return "the cast keeps +/-Inf (e5m2 has Inf): the GEMM's output is Inf or NaN"
        return (
            "dynamic scaling takes amax = Inf (or NaN), so scale = max / amax = 0 (or NaN) and every "
            "output element of this GEMM is NaN"
        )

    def _next_steps(self) -> list[str]:
        f = self.fields
        if f.get("output"):
            return ["ask for a wider output (out_dtype=torch.float32) or scale the operands down"]
        if f.get("nan_codes"):
            return [
                "the codes were NaN (or Inf) when cast: cast under cublas_guard_ext.fp8.checked_fp8() to "
                "name the cast, or check the high-precision tensor before it"
            ]
        if f.get("operand") == "grad_output":
            return [
                "the gradient arriving at this layer is already non-finite: find where it was born in "
                "the backward pass (cublas_guard_ext.watch(model) around the loss and backward)",
                "a loss scale too high, or a division by a zero count in the loss, are the usual causes",
            ]
        if f.get("operand") == "weight":
            return [
                "the weight itself holds NaN/Inf: an earlier optimizer step wrote it; restore the last "
                "checkpoint and find the step (cublas_guard_ext.TrainingGuard refuses such steps)",
            ]
        return [
            "the value was born upstream: cublas_guard_ext.watch(model) names the op that made it",
            "if it is an activation overflow in bf16/fp16, clamp it or keep that layer out of float8 "
            "(torchao's module_filter_fn)",
        ]


class Fp8ScaleError(GuardError, ValueError):
    """A float8 scale that is not a finite number > 0 (or whose reciprocal is not finite): an
    Inf scale makes the GEMM NaN, a zero scale makes it zeros, a NaN scale NaN."""

    kind = "fp8_scale"

    def _headline(self) -> str:
        f = self.fields
        return (
            f"{_where(f)}: {f.get('bad_count')} of {f.get('count')} scale values are not finite and > 0 "
            f"(first: {f.get('first_bad_value')} at index {f.get('first_bad_index')})"
        )

    def _details(self) -> list[str]:
        f = self.fields
        lines = []
        scale = _scale_line(f)
        if scale:
            lines.append(f"scaling: {scale}")
        if f.get("scale_name"):
            lines.append(f"scale argument: {f['scale_name']} shape {_shape(f.get('scale_shape'))}")
        return lines

    def _next_steps(self) -> list[str]:
        value = str(self.fields.get("first_bad_value"))
        if value in ("0.0", "0", "-0.0"):
            return [
                "a scale of 0 comes from an amax of Inf: the tensor it was computed from holds an Inf; "
                "check it before the amax (cublas_guard_ext.watch names where the Inf was born)"
            ]
        if "inf" in value:
            return [
                "an infinite scale comes from an amax of 0 (or a subnormal amax): clamp the amax from "
                "below (torchao: EPS=1e-12; rowwise LoRA: activation_value_lb)"
            ]
        return ["a NaN scale comes from a NaN amax: the tensor it was computed from holds a NaN"]


class Fp8RangeWarning(UserWarning):
    """More of an operand's values saturate at the float8 format's largest value, or flush to
    zero below its smallest subnormal, than the threshold allows (docs/fp8.md: the thresholds
    and what clean training measured). Finite and silent otherwise."""


def range_message(fields: dict[str, Any]) -> str:
    """The text of Fp8RangeWarning and Fp8RangeError."""
    f = fields
    parts = []
    if f.get("saturated"):
        parts.append(
            f"{f['saturated']} of {f.get('numel')} values ({f.get('saturated_fraction', 0):.3%}) saturate "
            f"at +/-{_num(f.get('fp8_max'))}"
        )
    if f.get("flushed"):
        parts.append(
            f"{f['flushed']} of {f.get('nonzero')} nonzero values ({f.get('flushed_fraction', 0):.3%}) flush "
            f"to zero (at or below half the smallest subnormal, {_num(f.get('fp8_tiny'))}, after scaling)"
        )
    text = f"cublas_guard_ext: {_where(f)}: " + "; ".join(parts)
    scale = _scale_line(f)
    if scale:
        text += f"\n  scaling: {scale}"
    text += (
        f"\n  thresholds: saturated > {f.get('saturate_limit'):.3%}, flushed > {f.get('flush_limit'):.3%} "
        "(cublas_guard_ext.fp8.set_thresholds)"
    )
    if f.get("flushed"):
        text += (
            "\nNext: one outlier sets a tensorwise scale for everything: scale per row (torchao's "
            "'rowwise' recipe), or clip or normalize that activation; "
            "keep this layer in high precision (module_filter_fn) if neither helps"
        )
    else:
        text += (
            "\nNext: the scale does not cover the tensor's range (a stale or shared amax): recompute "
            "the amax from this tensor, or use dynamic scaling"
        )
    return text


class Fp8RangeError(GuardError, ValueError):
    """Fp8RangeWarning raised as an error (strict: ``cublas_guard_ext.fp8.set_thresholds(strict=True)``
    or ``CUBLAS_GUARD_FP8_STRICT=1``)."""

    kind = "fp8_range"

    def _format(self) -> str:
        return range_message(self.fields)


class Fp8ArgumentError(GuardError, ValueError):
    """A direct scaled GEMM's or a float8 layer's arguments that do not fit: operands in the wrong
    layout for ``torch._scaled_mm``, scale shapes that match no recipe, a float8 dtype the device
    lacks, a torchao older than the supported floor."""

    kind = "fp8_argument"

    def _headline(self) -> str:
        f = self.fields
        return f"{f.get('op', 'float8')}: {f.get('problem')}"

    def _details(self) -> list[str]:
        return [f"{k}: {v}" for k, v in self.fields.items() if k not in ("op", "problem", "next", "rank")]

    def _next_steps(self) -> list[str]:
        step = self.fields.get("next")
        return [step] if step else []


TORCHAO_TOO_OLD = (
    "cublas_guard_ext: torchao {version} is older than {floor}, the oldest whose Float8Linear the "
    "guard knows; its Float8Linear layers are left unguarded ({count}). Upgrade: pip install "
    "'torchao>={floor}'."
)

TORCHAO_TOO_OLD_REASON = (
    "torchao Float8Linear, not guarded: torchao {version} is older than {floor}, the oldest the "
    "guard knows (pip install 'torchao>={floor}')"
)

FLOAT8_LEFT_REASON = (
    "torchao Float8Linear, not guarded: replace_linear(model) guards its three FP8 GEMMs "
    "(torchao >= {floor}; docs/fp8.md)"
)

# The texts of fp8/direct.py's argument checks: Fp8ArgumentError's problem and next step, and what
# a device lacks (written here, filled there).
ARGUMENT_TEXTS = {
    "fnuz_on_nvidia": "{name} is ROCm's (MI300) format; NVIDIA GPUs run float8_e4m3fn and float8_e5m2",
    "old_gpu": "FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper, Blackwell); this GPU is sm_{major}{minor}",
    "fnuz_not_mi300": "{name} is the MI300 (gfx94x) format; {gfx} runs float8_e4m3fn and float8_e5m2",
    "ocp_on_mi300": "{gfx} (MI300) runs float8_e4m3fnuz and float8_e5m2fnuz, not {name}",
    "not_float8": "{name} is {dtype}, not a float8 dtype",
    "not_float8_next": "cast it with a scale first: ({name}_hp * scale).to(torch.float8_e4m3fn)",
    "device_lacks": "{name}: {why}",
    "device_lacks_next": "cast to a format the device runs",
    "layout": (
        "{name} {shape} with strides {strides} is not {want}: cuBLASLt's FP8 GEMM takes mat_a row-major "
        "and mat_b column-major only (the CPU path accepts more, the same code then fails on a GPU)"
    ),
    "layout_next_mat_b": "pass mat_b as weight.t() of a contiguous [N, K] weight (or b.t().contiguous().t())",
    "layout_next_mat_a": "pass mat_a.contiguous()",
    "scale_shapes": (
        "scale_a {sa} and scale_b {sb} match no float32 recipe for a [{m}, {k}] x [{k2}, {n}] product: "
        "tensorwise takes one value each, rowwise scale_a [{m}, 1] and scale_b [1, {n}]"
    ),
    "scale_shapes_next": "compute the scales per tensor (amax over all) or per row of mat_a and column of mat_b",
}
