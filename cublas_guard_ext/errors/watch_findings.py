"""watch's findings: an op that produced NaN/Inf (NonFiniteOutputError), a model input,
parameter or buffer non-finite on entry (NonFiniteEntryError), values no op made
(NonFiniteFromNowhereError), a CUDA graph capture inside a block (WatchCaptureError).
Raised by cublas_guard_ext.watching; written here with every other message."""

from __future__ import annotations

import re
from typing import Any

import torch

from . import nan_from_inf as _nan_from_inf
from . import optimizer_step as _optimizer_step
from .base import GuardError
from .entries import entry_lines as _entry_lines
from .entries import entry_next_steps as _entry_next_steps
from .experts import past_groups_details, past_groups_steps
from .format import (
    _PRODUCER_HINTS,
    _coords,
    _counts_text,
    _dtype,
    _first_bad_line,
    _fold_inputs,
    _inputs_line,
    _shape,
    _value_name,
    _where,
)
from .inputs import NonFiniteInputError
from .magnitudes import counts_line, format_number, magnitude_line
from .overflow import finding_lines, finding_overflow, narrow_format, next_steps


class _WatchFinding:
    """What watch's findings share: every field the docs list is there (None when not
    known), the first bad element's coordinates, the counts and the magnitudes that
    explain them."""

    # Fields every instance has (docs/watch.md lists them): None when not known.
    WATCH_FIELDS: tuple[str, ...] = (
        "op", "module", "outside", "phase", "backward_node", "output_index", "nan_count", "posinf_count",
        "neginf_count", "zero_count", "first_bad_index", "first_bad_coords", "first_bad_value", "shape",
        "dtype", "device", "input_names", "input_shapes", "input_dtypes", "input_strides",
        "input_absmax", "reached", "birth_stack", "detected_stack", "lost", "mode",
        "overflow", "dtype_max", "overflow_bound",
    ) + _optimizer_step.OPTIMIZER_FIELDS  # fmt: skip

    def __init__(self, message: str | None = None, **fields: Any) -> None:
        self._prepare(fields)
        if fields.get("first_bad_coords") is None:
            fields["first_bad_coords"] = _coords(fields.get("first_bad_index"), fields.get("shape"))
        for name in self.WATCH_FIELDS:
            fields.setdefault(name, None)
        super().__init__(message, **fields)  # type: ignore[call-arg]

    def _prepare(self, fields: dict[str, Any]) -> None:
        pass

    def _explained(self) -> list[str]:
        """The counts at the producing op and the inputs' magnitudes (errors/magnitudes.py)."""
        f = self.fields
        lines = []
        counts = counts_line(f)
        if counts and f.get("zero_count") is not None:
            lines.append(f"counts at that op: {counts}")
        magnitudes = magnitude_line(f.get("input_absmax"), f.get("dtype"), is_product=bool(f.get("product")))
        if magnitudes:
            lines.append(magnitudes)
        return lines


class NonFiniteOutputError(_WatchFinding, GuardError, ValueError):
    """An op inside a ``watch`` block produced NaN/+Inf/-Inf from finite inputs."""

    kind = "non_finite_output"

    def _in_optimizer_step(self) -> bool:
        return self.fields.get("phase") == "optimizer step" and self.fields.get("op") is not None

    def _prepare(self, fields: dict[str, Any]) -> None:
        _fold_inputs(fields)
        if "overflow" not in fields:
            fields.update(finding_overflow(fields) or {})

    def _headline(self) -> str:
        f = self.fields
        if f.get("op") is None:  # the birth was lost before watch read it (see `lost`)
            return f"watch: non-finite values reached {f.get('reached')}; the op that made them is not known"
        if self._in_optimizer_step():
            return _optimizer_step.headline(f, _counts_text(f))
        overflowed = (
            f" overflowed {_dtype(f.get('dtype')).replace('torch.', '')}:" if f.get("overflow") else ""
        )
        source = _nan_from_inf.headline_tail() if _nan_from_inf.applies(f) else "from finite inputs"
        return (
            f"watch: {f.get('op')} {_where(f)} ({f.get('phase') or 'forward'}){overflowed} produced "
            f"{_counts_text(f)} {source}"
        )

    def _details(self) -> list[str]:
        f = self.fields
        if f.get("op") is None:
            return [f"lost: {f['lost']}"] if f.get("lost") else []
        first = _first_bad_line(f, "output")
        if f.get("first_bad_value") is not None:
            first += f" ({_value_name(f.get('first_bad_value'))})"
        lines = [
            first,
            f"output: shape {_shape(f.get('shape'))} {_dtype(f.get('dtype'))} on {f.get('device')}",
        ]
        judged = _optimizer_step.judged_at_return(f) if self._in_optimizer_step() else None
        inputs = judged or _inputs_line(f)
        if inputs:
            lines.append(inputs)
        if self._in_optimizer_step():  # the state's and gradient's magnitudes, read from the optimizer
            counts = counts_line(f)
            return (
                lines
                + ([f"counts at that op: {counts}"] if counts and not judged else [])
                + _optimizer_step.details(f)
                + _where_it_went(f)
            )
        lines += past_groups_details(f) or self._explained()
        lines += finding_lines(f)
        if _nan_from_inf.applies(f):
            lines += _nan_from_inf.details(f)
        if f.get("backward_node"):
            lines.append(
                f"in backward, computing {f['backward_node']} (the gradient of that module's forward)"
            )
        if f.get("deferred"):
            lines.append(
                "recorded at that op (mode='async') and reported now: outputs computed since then "
                "are not to be trusted"
            )
        return lines + _where_it_went(f)

    def _next_steps(self) -> list[str]:
        if self.fields.get("op") is None:
            return ["run the step again with a larger watch(..., capacity=...) to name the op"]
        if self._in_optimizer_step():
            return _optimizer_step.next_steps(self.fields)
        if self.fields.get("overflow"):
            f = self.fields
            steps = next_steps(f, f"module '{f['module']}'" if f.get("module") else "this op")
            return _attention_scores_steps(f) + _router_steps(f) + steps
        if _nan_from_inf.applies(self.fields):
            return _nan_from_inf.next_steps(self.fields)
        op = str(self.fields.get("op", "")).split(".")
        base = op[1] if len(op) > 1 else ""
        sink = _float8_sink(self.fields)
        steps = _float8_sink_steps(sink) if sink else past_groups_steps(self.fields)
        hint = _PRODUCER_HINTS.get(base.rstrip("_")) or _PRODUCER_HINTS.get(base.split("_")[0])
        if hint:
            steps.append(f"likely {hint}")
        if not sink:  # a value a float8 cast clipped is lost, not intended
            steps.append(
                "if these values are intended there, pass the op or the module to watch(..., allow=[...])"
            )
        return steps


def _where_it_went(f: dict[str, Any]) -> list[str]:
    """Where the values went (watch's consequence rule) and what was lost, before the Next steps."""
    lines = [f"reached: {f['reached']}"] if f.get("reached") and f.get("op") is not None else []
    return lines + ([f"lost: {f['lost']}"] if f.get("lost") and f.get("op") is not None else [])


def _float8_sink(f: dict[str, Any]) -> torch.dtype | None:
    """The Inf-less float8 format whose cast or copy swallowed the values (watch names it in
    ``reached``), or None. Inf-less by its name: "fn" is the finite-only formats' suffix
    (float8_e4m3fn, float8_e4m3fnuz, float8_e5m2fnuz, float8_e8m0fnu). Not asked of torch by a cast:
    this runs inside watch (and under run's checked float8 casts, which would refuse the Inf)."""
    for word in re.findall(r"\bfloat8_\w+", str(f.get("reached") or "")):
        dtype = getattr(torch, word, None)
        if isinstance(dtype, torch.dtype) and re.search(r"fn(uz|u)?$", word):
            return dtype
    return None


def _float8_sink_steps(dtype: torch.dtype) -> list[str]:
    name, largest = str(dtype).replace("torch.", ""), format_number(float(torch.finfo(dtype).max))
    return [
        f"fix the values here, where they were born, not at the cast: {name} has no Inf, so the "
        f"cast saturated them to +-{largest} and training would have gone on with them, with no "
        "error and no NaN downstream",
        "the inputs' magnitudes above say how far out of range they were: bring that activation "
        "back in range before its FP8 GEMM (a normalization, or a clamp), and if it grew over "
        "steps, lower the learning rate or clip gradients",
    ]


_SCORE_OPS = ("matmul", "bmm", "baddbmm", "mm", "einsum")


def _attention_scores_steps(f: dict[str, Any]) -> list[str]:
    """An overflow in a product of an attention module (q @ k^T): the attention-specific fixes."""
    op = str(f.get("op") or "").split(".")
    module = str(f.get("module") or "").lower()
    if len(op) < 2 or op[1] not in _SCORE_OPS or not any(w in module for w in ("attn", "attention")):
        return []
    return [
        "in attention: scale q by 1/sqrt(head_dim) before the product ((q * scale) @ k.transpose(-2, "
        "-1), not (q @ k.transpose(-2, -1)) * scale), or use F.scaled_dot_product_attention, which "
        "scales first and accumulates q.k in float32"
    ]


def _router_steps(f: dict[str, Any]) -> list[str]:
    """An overflow in a mixture of experts' router (its logits past the range): router
    instability, what router z-loss exists to fight."""
    last = str(f.get("module") or "").rsplit(".", 1)[-1].lower()
    if last not in ("gate", "router") and not last.endswith("router"):
        return []
    return [
        "router logits past the range are router instability: they grow during training until the "
        "softmax saturates; add a router z-loss (ST-MoE: 1e-3 * logsumexp(router_logits, -1).square().mean() "
        "added to the loss), keep the router in float32, and clip gradients"
    ]


class NonFiniteEntryError(_WatchFinding, NonFiniteInputError):
    """A watched model's argument, parameter or buffer held NaN/Inf when it entered the model."""

    kind = "non_finite_entry"
    WATCH_FIELDS = _WatchFinding.WATCH_FIELDS + ("role", "name", "bad_slices")

    def _headline(self) -> str:
        f = self.fields
        return (
            f"watch: the model's {f.get('role')} '{f.get('name')}' has {_counts_text(f)} on entry "
            "(it came into the model non-finite; no op inside produced it)"
        )

    def _details(self) -> list[str]:
        f = self.fields
        lines = [
            _first_bad_line(f, str(f.get("name"))),
            f"shape {_shape(f.get('shape'))} {_dtype(f.get('dtype'))}",
        ] + self._explained()
        lines += _entry_lines(f)
        fmt = narrow_format(f) if f.get("role") == "argument" else None
        if fmt is not None:
            lines.append(
                f"Inf alone, no NaN, in {fmt[0]}: most likely values past {fmt[0]}'s largest, "
                f"{fmt[1]:g}, cast to it before the model (x.to({_dtype(f.get('dtype'))}) of data that large)"
            )
        return lines

    def _next_steps(self) -> list[str]:
        return _entry_next_steps(self.fields)


class NonFiniteFromNowhereError(GuardError, ValueError):
    """``watch(..., verify_inputs=True)``: an op read NaN/Inf from a tensor watch saw produced
    finite, at the same version: no op made it. A write outside stream order (a stream race,
    memory freed too early, another process, a write through a numpy view or ``.data``)."""

    kind = "watch_from_nowhere"

    def __init__(self, message: str | None = None, **fields: Any) -> None:
        if "dtype" in fields:
            fields["dtype"] = _dtype(fields["dtype"])
        for name in ("reader", "argument", "producer", "module", "phase", "shape", "dtype", "device"):
            fields.setdefault(name, None)
        super().__init__(message, **fields)

    def _headline(self) -> str:
        f = self.fields
        return (
            f"watch: {f.get('reader')} read {f.get('nan_count')} NaN, {f.get('posinf_count')} +Inf, "
            f"{f.get('neginf_count')} -Inf from its argument '{f.get('argument')}', which "
            f"{f.get('producer')} had produced finite (same version): no op made these values"
        )

    def _details(self) -> list[str]:
        f = self.fields
        return [
            f"argument: shape {list(f.get('shape') or [])} {f.get('dtype')} on {f.get('device')}, "
            f"first bad element at flat index {f.get('first_bad_index')}",
            f"read in {f.get('phase') or 'forward'}"
            + (f" in module '{f['module']}'" if f.get("module") else ""),
        ]

    def _next_steps(self) -> list[str]:
        return [
            "a write outside stream order: a tensor used on another stream without "
            "record_stream/wait_stream, memory freed too early, or written behind torch's back "
            "(a numpy view, .data, a raw pointer)",
            "on CUDA, CUDA_LAUNCH_BLOCKING=1 serializes the streams: if it then passes, it is a race",
        ]


class WatchCaptureError(GuardError, RuntimeError):
    """CUDA graph capture was asked for inside a ``watch`` block (or a block was entered during one).

    watch reads what its scans found on the host, which a capture forbids; it refuses before
    anything is captured, so the capture can be retried outside the block."""

    kind = "watch_graph_capture"

    def _headline(self) -> str:
        return (
            f"watch: CUDA graph capture {self.fields.get('when', 'inside a watch block')}: watch reads "
            "its scan results on the host, which a capture forbids; nothing was captured"
        )

    def _details(self) -> list[str]:
        return []

    def _next_steps(self) -> list[str]:
        return [
            "capture outside the watch block (watch an eager run of the same step to find a NaN's "
            "origin), or guard the captured step with cublas_guard_ext.guard('async')"
        ]
