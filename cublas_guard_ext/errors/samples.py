"""The messages of TrainingGuard's samples: ``sample_ids`` that cannot name the rows of a
batch (:class:`SampleIdsError`), a skip list that cannot be read or written
(:class:`SkipListError`), and the lines a step's error and warnings show about the samples
behind it. Plain values in, text out (no torch import), like every message of this package.
"""

from __future__ import annotations

from typing import Any

from .base import GuardError


def _ids(values: list[Any], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    more = len(values) - limit
    return shown + (f" and {more} more" if more > 0 else "")


class SampleIdsError(GuardError, ValueError):
    """``guard.step(closure, sample_ids=...)`` with ids that cannot name the batch's rows.

    Fields: ``problem`` (``"type"``, ``"shape"``, ``"device"``, ``"not_integer"``,
    ``"duplicate"``, ``"empty"``, ``"length"``, ``"no_ids"``), ``step``, and what the problem is about:
    ``got`` (a type or dtype), ``shape``, ``device``, ``index`` and ``value`` (the first
    non-integer), ``value`` and ``rows`` (a duplicate id and its rows), ``count`` (ids given),
    ``batch_rows`` (rows per model call), ``argument`` and ``argument_shape``.
    """

    kind = "sample_ids"

    def _headline(self) -> str:
        f = self.fields
        where = f"TrainingGuard.step (step {f.get('step')})"
        p = f.get("problem")
        if p == "type":
            return f"{where}: sample_ids must be a list of ints or a 1-D integer tensor, got {f.get('got')}"
        if p == "shape":
            return (
                f"{where}: sample_ids must be 1-D (one id per row of the batch), got shape {f.get('shape')}"
            )
        if p == "device":
            return (
                f"{where}: sample_ids is on {f.get('device')}; the ids are looked up on the host "
                "before the closure runs, and reading them from a device would sync it every step"
            )
        if p == "not_integer":
            return (
                f"{where}: sample_ids must hold integers; element {f.get('index')} is "
                f"{f.get('value')!r} ({f.get('got')})"
            )
        if p == "duplicate":
            rows = f.get("rows") or []
            return (
                f"{where}: sample_ids holds {f.get('value')} more than once (rows "
                f"{', '.join(str(r) for r in rows)}): each row needs its own id"
            )
        if p == "no_ids":
            return f"{where}: batch= was given without sample_ids; batch= only says which rows the ids name"
        if p == "empty":
            return f"{where}: sample_ids is empty; pass one id per row of the batch, or leave it out"
        rows = f.get("batch_rows") or []
        seen = f"{rows[0]} rows" if len(rows) == 1 else f"{sum(rows)} rows in {len(rows)} calls ({rows})"
        return (
            f"{where}: sample_ids has {f.get('count')} ids, but the batch at the model's entry has "
            f"{seen} (its {f.get('argument')} has shape {f.get('argument_shape')})"
        )

    def _details(self) -> list[str]:
        return (
            ["nothing was applied: the step's gradients were dropped, the RNG states and buffers restored"]
            if (self.fields.get("problem") == "length")
            else []
        )

    def _next_steps(self) -> list[str]:
        if self.fields.get("problem") == "device":
            return ["keep the ids on the CPU (the DataLoader gives them there): ids, not ids.to(device)"]
        if self.fields.get("problem") == "length":
            return [
                "pass one id per row of the batch, in the batch's order (with gradient accumulation, "
                "the ids of every micro-batch, in order), or batch= the tensor whose rows they name"
            ]
        return [
            "pass one distinct integer id per row of the batch (a dataset that returns its index gives them)"
        ]


class SkipListError(GuardError, OSError):
    """``TrainingGuard(skip_list=PATH)`` with a path that cannot be read or appended to.
    Raised at construction, never at a later step. Fields: ``path``, ``problem``
    (``"directory"``, ``"unreadable"``, ``"unwritable"``), ``reason`` (the OS's words)."""

    kind = "skip_list"

    def _headline(self) -> str:
        f = self.fields
        what = {
            "directory": "is a directory, not a file",
            "unreadable": "cannot be read",
            "unwritable": "cannot be appended to",
        }.get(f.get("problem"), "cannot be used")
        return f"TrainingGuard: the skip list {f.get('path')} {what}" + (
            f" ({f['reason']})" if f.get("reason") else ""
        )

    def _details(self) -> list[str]:
        return [
            "the guard reads the list when it is built and appends the samples of every "
            "reproducible bad step to it; both must work before the first step"
        ]

    def _next_steps(self) -> list[str]:
        return ["give a path on a writable file system (shared by the ranks), or skip_list=None"]


def samples_line(samples: dict[str, Any]) -> str:
    """The error's line about the samples behind a bad step."""
    if not samples.get("mapped") or not samples.get("ids"):
        return f"samples: none named ({samples.get('note') or 'the rows could not be told apart'})"
    rows = samples.get("rows") or []
    count = samples.get("batch")
    line = (
        f"samples: {_ids(samples['ids'])} (row{'s' if len(rows) > 1 else ''} {_ids(rows)} of {count}; "
        f"{samples.get('where')})"
    )
    if samples.get("note"):
        line += f"; {samples['note']}"
    return line


def skip_list_line(path: str, count: int) -> str:
    return f"skip list: {count} sample{'s' if count != 1 else ''} appended to {path}; later batches holding them are skipped"


def listed_batch_skipped(step: int, hits: list[Any], rank: int | None, path: str) -> str:
    """The warning of a batch skipped before its closure ran."""
    if hits:
        who = f"it holds listed sample{'s' if len(hits) > 1 else ''} {_ids(hits)}"
    else:
        who = "another rank's batch holds a listed sample (every rank skips alike)"
    prefix = f"[rank {rank}] " if rank is not None else ""
    return (
        f"{prefix}training step {step}: skipped before its closure ran: {who} (skip list {path}); "
        "no forward, backward or optimizer step; the RNG states and buffers are unchanged"
    )


def skip_list_ignored(path: str, lines: list[tuple[int, str]]) -> str:
    """The warning of skip-list lines that could not be read (a write cut short, say)."""
    shown = "; ".join(f"line {n}: {why}" for n, why in lines[:4])
    more = len(lines) - 4
    return (
        f"TrainingGuard: skip list {path}: ignored {len(lines)} line{'s' if len(lines) != 1 else ''} "
        f"that could not be read ({shown}{f'; and {more} more' if more > 0 else ''}); the other "
        "lines are kept (a line torn by a crash mid-write is expected once)"
    )


def spike_samples_line(spike: dict[str, Any]) -> str:
    """A spike verdict's line about its samples (per-sample losses), or the batch."""
    if spike.get("ids"):
        return (
            f"samples: {_ids(spike['ids'])} (per-sample loss {_ids(spike.get('losses') or [])} against a "
            f"batch median of {spike.get('median'):.6g}; {spike.get('why')})"
        )
    return f"samples: the whole batch ({spike.get('why')})"


def spike_text(spike: dict[str, Any], listed_in: str | None) -> str:
    """The samples of a spike skipped by on_spike="skip", and the skip list they went to."""
    line = spike_samples_line(spike)
    if listed_in and spike.get("ids"):
        line += "\n  " + skip_list_line(listed_in, len(spike["ids"]))
    return line
