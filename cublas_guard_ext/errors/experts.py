"""The messages about a mixture of experts' experts (cublas_guard_ext.models.experts): the place line
every error raised inside one expert carries, the offsets error, the experts implementation's
refusals, and what coverage() says about experts modules."""

from __future__ import annotations

from typing import Any

from .base import GuardError
from .format import _dtype, _layer


class GroupOffsetsError(GuardError, ValueError):
    """The group ends (``offs``) of a grouped GEMM are not usable: not ascending, negative,
    past the input's rows, or not integers. Nothing was computed."""

    kind = "group_offsets"

    def _headline(self) -> str:
        f = self.fields
        reason, expert = f.get("reason"), f.get("expert")
        offsets = f.get("offsets") or []
        where = f"layer {_layer(f.get('layer'))}"
        if reason == "dtype":
            return f"{where}: the group offsets are {_dtype(f.get('dtype'))}; they must be int32 (or int64)"
        if reason == "negative":
            return f"{where}: the group offsets start at {offsets[0] if offsets else '?'} (negative)"
        if reason == "past_tokens":
            end = offsets[expert] if isinstance(expert, int) and expert < len(offsets) else "?"
            return (
                f"{where}: expert {expert}'s group ends at row {end}, past the input's "
                f"{f.get('num_tokens')} rows"
            )
        previous = offsets[expert - 1] if isinstance(expert, int) and 0 < expert <= len(offsets) else "?"
        end = offsets[expert] if isinstance(expert, int) and expert < len(offsets) else "?"
        return (
            f"{where}: the group offsets are not ascending: expert {expert} ends at row {end}, "
            f"before expert {(expert or 1) - 1}'s end {previous}"
        )

    def _details(self) -> list[str]:
        f = self.fields
        lines = []
        if f.get("offsets") is not None:
            lines.append(f"offsets (cumulative group ends, one per expert): {f['offsets']}")
        if f.get("num_tokens") is not None:
            lines.append(f"input rows (tokens x top_k, sorted by expert): {f['num_tokens']}")
        lines.append("nothing was computed: the call was refused before any GEMM")
        return lines

    def _next_steps(self) -> list[str]:
        if self.fields.get("reason") == "dtype":
            return ["make the offsets an integer tensor: torch.cumsum(counts, 0, dtype=torch.int32)"]
        return [
            "the offsets must be the cumulative token counts per expert of the rows as sorted: "
            "torch.cumsum(torch.bincount(sorted_ids, minlength=num_experts), 0, dtype=torch.int32)",
            "the rows must be sorted by expert (torch.sort(expert_ids)) before the grouped GEMM",
        ]


class ExpertsImplementationError(GuardError, TypeError):
    """An experts module the ``cublas_guard`` implementation cannot run (a layout it does not
    know), or transformers refusing to select it."""

    kind = "experts_implementation"

    def _headline(self) -> str:
        f = self.fields
        return f"experts module {_layer(f.get('module'))} ({f.get('module_type')}): {f.get('reason')}"

    def _details(self) -> list[str]:
        return [str(d) for d in self.fields.get("notes") or []]

    def _next_steps(self) -> list[str]:
        return [
            "run this module with transformers' own implementation (model.set_experts_implementation"
            "('grouped_mm')); cublas_guard_ext.coverage(model) lists it as left unguarded"
        ]


# watch: a grouped GEMM's output non-finite past the last group end.
def past_groups_details(f: dict[str, Any]) -> list[str]:
    """Why rows past offs[-1] of a grouped GEMM hold non-finite values (watch's finding)."""
    if not f.get("past_groups"):
        return []
    row = f.get("first_bad_coords", [None])[0] if f.get("first_bad_coords") else None
    return [
        f"the first bad row ({row}) is past the last group end (offs[-1] = {f.get('groups_end')}): no "
        "group owns it, and torch's grouped_mm leaves those rows of its output, and of its input "
        "gradient, uninitialized by design (pytorch/pytorch#193633): memory the allocator recycles "
        "holds whatever was there, NaN included, and 0 x NaN = NaN, so zero routing weights do not "
        "hide them"
    ]


def past_groups_steps(f: dict[str, Any]) -> list[str]:
    if not f.get("past_groups"):
        return []
    return [
        "zero-fill the rows past offs[-1] before anything reads them (out[offs[-1]:] = 0 or a "
        "masked_fill on the rows, in forward and on the input gradient), or compact the input to its "
        "first offs[-1] rows; cublas_guard_ext's grouped GEMM (replace_linear, or "
        "set_experts_implementation('cublas_guard')) returns zeros there"
    ]


# coverage(): why an experts module is or is not guarded.
def experts_left_reason(implementation: Any) -> str:
    return (
        f"transformers experts running the {implementation!r} implementation (torch's bmm / grouped_mm, "
        "not guarded): cublas_guard_ext.replace_linear(model) selects the 'cublas_guard' implementation "
        "for every experts module"
    )


def experts_other_reason(implementation: Any) -> str:
    return (
        f"transformers experts running the {implementation!r} implementation, a kernel of its own "
        "(not torch's GEMMs) that replace_linear leaves as chosen"
    )


def fused_3d_reason(shapes: str) -> str:
    return (
        f"fused 3-D weights ({shapes}, e.g. a mixture of experts' stacked expert weights) multiplied in "
        "its own forward (bmm, einsum, grouped_mm), not through a Linear or transformers' experts "
        "interface: not guarded"
    )
