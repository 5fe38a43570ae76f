"""The errors about what a guarded call was given: wrong dtype, shape or device, non-finite
values, sizes beyond cuBLAS's 32-bit limit, an extension that cannot load (watch's findings
are in watch_findings.py). Each subclasses the built-in exception nn.Linear users already
catch."""

from __future__ import annotations

from typing import Any

from .base import GuardError
from .format import (
    _dtype,
    _layer,
    _routines_on,
    _shape,
    _value_name,
)
from .overflow import narrow_format, next_steps, refusal_lines
from .status import _NAN_STORY


class DTypeError(GuardError, TypeError, RuntimeError):
    """An operand's dtype is not float32/bfloat16/float16/float64, or input and
    parameters differ in dtype (``nn.Linear`` refuses both too)."""

    kind = "dtype"

    def _headline(self) -> str:
        f = self.fields
        role, dtype = f.get("role", "input"), _dtype(f.get("dtype"))
        if f.get("reason") == "mismatch":
            return (
                f"layer {_layer(f.get('layer'))}: {role} dtype is {dtype} but {f.get('other_role')} "
                f"dtype is {_dtype(f.get('other_dtype'))}: they must match (nn.Linear refuses "
                "them too)"
            )
        return (
            f"layer {_layer(f.get('layer'))}: {role} dtype is {dtype}, but the guarded linear "
            "takes float32, bfloat16, float16 or float64 (as nn.Linear does)"
        )

    def _details(self) -> list[str]:
        device = self.fields.get("tensor_device")
        return [
            f"shape {_shape(self.fields.get('tensor_shape'))} on {device}",
            f"on {'CUDA' if str(device).startswith('cuda') else 'the CPU'} the GEMM runs as "
            f"{_routines_on(device)}",
        ]

    def _next_steps(self) -> list[str]:
        f = self.fields
        role, dtype = f.get("role", "input"), _dtype(f.get("dtype"))
        if f.get("reason") == "mismatch":
            other = _dtype(f.get("other_dtype"))
            if role in ("input", "grad_output"):
                return [
                    f"cast the {role} to the layer's dtype: x = x.to({other})",
                    f"or cast the layer: layer.to({dtype})",
                    "or run the model under torch.autocast(device_type, dtype), which casts "
                    "SafeLinear's operands exactly as nn.Linear's",
                ]
            return [f"cast the layer's parameters to one dtype: layer.to({other})"]
        if role == "input":
            steps = ["convert the input: x = x.float() (or the layer's dtype)"]
            if dtype.startswith("torch.complex"):
                steps.append("complex GEMMs are not guarded: split real and imaginary parts")
            elif not dtype.startswith("torch.float"):
                steps.append("integer/bool features are usually indices: did you mean an nn.Embedding?")
            return steps
        return [f"convert the layer's parameters: layer.float() (its {role} is {dtype})"]


class ShapeMismatchError(GuardError, ValueError, RuntimeError):
    """The input's last dim is not the layer's ``in_features`` (or the input is 0-d)."""

    kind = "shape_mismatch"

    def _headline(self) -> str:
        f = self.fields
        shape = f.get("shape")
        if f.get("reason") == "operand":  # a parameter or gradient, not the input
            return (
                f"layer {_layer(f.get('layer'))}: {f.get('role')} has shape {_shape(shape)}, "
                f"expected {f.get('expected_shape')}"
            )
        expected = f.get("expected_last_dim")
        if f.get("reason") == "zero_dim":
            return f"layer {_layer(f.get('layer'))}: input is 0-d; expected [..., {expected}]"
        return (
            f"layer {_layer(f.get('layer'))}: input shape {_shape(shape)} has last dim "
            f"{shape[-1] if shape else '?'}, expected in_features = {expected}"
        )

    def _details(self) -> list[str]:
        f = self.fields
        if f.get("reason") == "operand":
            return []
        return [
            f"input shape: {_shape(f.get('shape'))}",
            f"expected:    [..., {f.get('expected_last_dim')}]",
        ]

    def _next_steps(self) -> list[str]:
        if self.fields.get("reason") == "operand":
            return [
                f"the layer's {self.fields.get('role')} was replaced with a tensor of the wrong "
                "shape; check the code that assigns it"
            ]
        return [
            "check the layer before this one (its out_features) or the flatten/reshape "
            "feeding it; print(x.shape) right before the layer"
        ]

    @property
    def expected(self) -> Any:
        f = self.fields
        return f.get("expected_last_dim", f.get("expected_shape"))


class DeviceMismatchError(GuardError, ValueError, RuntimeError):
    """An operand is on another device than the layer's weight.

    A weight (or bias) on the ``meta`` device has a shape and no values: the model was built
    under accelerate's ``init_empty_weights`` (or with ``device="meta"``) and its weights were
    never loaded; the message says so and how to load them, instead of moving tensors.
    """

    kind = "device_mismatch"

    def _meta_operand(self) -> str | None:
        """'weight'/'bias' when the layer's parameter is on meta; 'input' when the input is."""
        f = self.fields
        role, anchor = f.get("role", "input"), f.get("anchor", "weight")
        if f.get("weight_device") == "meta":
            return anchor
        if f.get("input_device") == "meta":
            return role
        return None

    def _headline(self) -> str:
        f = self.fields
        meta = self._meta_operand()
        if meta in ("weight", "bias"):
            return (
                f"layer {_layer(f.get('layer'))}: its {meta} is on the meta device (a shape, no values): "
                "the model's weights were never loaded (built under init_empty_weights or with "
                "device='meta')"
            )
        return (
            f"layer {_layer(f.get('layer'))}: {f.get('role', 'input')} is on "
            f"{f.get('input_device')} but the layer's {f.get('anchor', 'weight')} "
            f"is on {f.get('weight_device')}"
        )

    def _details(self) -> list[str]:
        return [f"{self.fields.get('role', 'input')} shape: {_shape(self.fields.get('shape'))}"]

    def _next_steps(self) -> list[str]:
        meta = self._meta_operand()
        if meta in ("weight", "bias"):
            return [
                "load the weights: model.load_state_dict(state_dict, assign=True), "
                "accelerate.load_checkpoint_and_dispatch(model, checkpoint), or build the model with "
                "from_pretrained(...)",
                f"for fresh weights: model.to_empty(device='{self.fields.get('input_device')}'), then "
                "initialise them (each layer's reset_parameters(), or the model's own init)",
            ]
        if meta is not None:
            return [
                f"the {meta} is a meta tensor (no values): make it on "
                f"'{self.fields.get('weight_device')}', where the layer's weights are"
            ]
        target = self.fields.get("weight_device")
        return [
            f"move the input: x = x.to('{target}')",
            f"or move the model: model.to('{self.fields.get('input_device')}')",
        ]


class NonFiniteInputError(GuardError, ValueError):
    """NaN/+Inf/-Inf in an input (or parameter) of a guarded layer."""

    kind = "non_finite"

    def _headline(self) -> str:
        f = self.fields
        where = f"layer {_layer(f.get('layer'))}"
        if f.get("deferred"):
            backward = "backward " if f.get("pass") == "backward" else ""
            where += f", {backward}call {f.get('call')}"
            replay = f.get("replay", 0)
            if replay:  # the call was captured in a CUDA graph; this is one of its replays
                where += f" (CUDA graph replay {replay})" if replay > 0 else " (a CUDA graph replay)"
        text = (
            f"{where}: {f.get('role', 'input')} has {f.get('nan_count')} NaN, "
            f"{f.get('posinf_count')} +Inf, {f.get('neginf_count')} -Inf"
        )
        fmt = self._overflowed()
        if fmt is not None:
            upstream = "in the backward pass" if f.get("role") == "grad_output" else "before this layer"
            text += f": most likely a {fmt[0]} overflow {upstream} (Inf alone, no NaN)"
        return text

    def _overflowed(self) -> tuple[str, float] | None:
        """(dtype, its largest value) when the refused input or gradient holds +/-Inf alone in a
        half-precision or fp8 tensor (errors/overflow.py)."""
        if self.fields.get("role", "input") not in ("input", "grad_output"):
            return None
        return narrow_format(self.fields)

    def _details(self) -> list[str]:
        f = self.fields
        coords = f.get("first_bad_coords")
        role = "x" if f.get("role", "input") == "input" else f.get("role")
        first = f"first bad element: flat index {f.get('first_bad_index')}"
        if coords is not None:
            first += f" = {role}[{', '.join(str(c) for c in coords)}]"
        if f.get("first_bad_value") is not None:
            first += f" ({_value_name(f.get('first_bad_value'))})"
        if f.get("shape") is not None:
            lines = [first, f"shape {_shape(f.get('shape'))}, {f.get('numel')} elements"]
        else:  # async records keep at most 16 dims
            lines = [first, f"{f.get('ndim')}-d tensor (shape not recorded), {f.get('numel')} elements"]
        if f.get("deferred"):
            lines.append(
                f"recorded asynchronously on {f.get('device')} at that call and reported now: "
                "outputs computed since then are not to be trusted"
            )
        if self._overflowed() is not None:
            lines += refusal_lines(f)
        lines.append(_NAN_STORY)
        return lines

    def _next_steps(self) -> list[str]:
        if self.fields.get("watch_on"):
            return self._next_steps_under_watch()
        if self._overflowed() is not None:
            return [
                "name the op that overflowed: run the step under cublas_guard_ext.watch(model); it "
                "reports the op, its module and its operands' magnitudes"
            ] + next_steps(self.fields, "the layer or op that overflowed")
        if self.fields.get("role") in ("weight", "bias"):
            return [
                "the parameters diverged: lower the learning rate, clip gradients "
                "(torch.nn.utils.clip_grad_norm_), or reload the last good checkpoint"
            ]
        return [
            "find the op that first made them non-finite: run the model under "
            "cublas_guard_ext.watch(model) (it names the op and module, in forward and "
            "backward), and check the data pipeline",
            "clean the data if NaN is expected there: torch.nan_to_num(x)",
        ]

    def _next_steps_under_watch(self) -> list[str]:
        """Refused inside a watch block (``watch_on``): watch is on and saw no op make these
        values, so the advice is where else they come from (never "run under watch")."""
        steps = []
        if self.fields.get("role") in ("weight", "bias"):
            steps.append(
                "the parameters diverged: lower the learning rate, clip gradients "
                "(torch.nn.utils.clip_grad_norm_), or reload the last good checkpoint"
            )
        return steps + [
            "watch is on and no op in its block made these values from finite ones: they were "
            "non-finite before the block began (data, a tensor made before the watched forward, a "
            "cache or buffer filled earlier), or an op or module in watch(..., allow=[...]) made them",
            "check where this tensor was made before the step; clean data where NaN is expected: "
            "torch.nan_to_num(x)",
        ]


class SizeLimitError(GuardError, ValueError):
    """A GEMM argument beyond cuBLAS's 32-bit ``int`` limit."""

    kind = "size_limit"

    def _headline(self) -> str:
        f = self.fields
        return (
            f"layer {_layer(f.get('layer'))}: {f.get('api') or 'cublasSgemm'} argument {f.get('argument')} = "
            f"{f.get('value')} exceeds cuBLAS's 32-bit limit {f.get('limit')}"
        )

    def _details(self) -> list[str]:
        f = self.fields
        return [
            f"{f.get('purpose')} GEMM: m={f.get('m')} n={f.get('n')} k={f.get('k')} "
            f"lda={f.get('lda')} ldb={f.get('ldb')} ldc={f.get('ldc')}",
            "cuBLAS's classic API takes m, n, k and the leading dimensions as 32-bit int; the "
            "batch is split and badly strided operands are copied automatically, but m (the "
            "output's width: out_features in forward, in_features in backward) cannot be "
            "split, and this cuBLAS has no 64-bit API (cuBLAS 12+)",
        ]

    def _next_steps(self) -> list[str]:
        steps = [
            "use a torch built with CUDA 12 or newer (cuBLAS 12 has the 64-bit API: "
            "cublasSgemm_64, cublasGemmEx_64, cublasDgemm_64)"
        ]
        if self.fields.get("argument") in ("lda", "ldb"):
            steps.append("a strided input's row stride is a leading dimension: x.contiguous() may fit")
        return steps


class ExtensionBuildError(GuardError, ImportError):
    """The native extension could not be loaded or built."""

    kind = "build"

    def _headline(self) -> str:
        return f"cublas_guard_ext: native extension unavailable: missing {self.fields.get('missing')}"

    def _details(self) -> list[str]:
        return [str(self.fields.get("detail", ""))]

    def _next_steps(self) -> list[str]:
        return [str(self.fields.get("fix", "see docs/building.md"))]
