"""A watched model's argument, parameter or buffer non-finite on entry: where the bad values sit
and what to do, by role (errors/watch_findings.py's NonFiniteEntryError).

A parameter that is non-finite diverged (or was loaded broken): the learning rate, clipping, a
checkpoint. A buffer is not trained, so that advice is wrong for it (issue 47, point 3): a
preallocated cache (``torch.empty``) or a buffer filled earlier holds whatever was there, and
when the bad values sit only in part of it (``bad_slices``: a KV cache's unused positions) a
mask does not keep them out of attention: the masked positions still enter the product with
weight 0, and 0 x NaN is NaN, so every output turns NaN. The fix is to fill it with zeros.
"""

from __future__ import annotations

from typing import Any

_CACHE_WORDS = ("cache", "past", "key", "value", "kv")


def _slices_text(f: dict[str, Any]) -> str | None:
    slices = f.get("bad_slices")
    if not slices:
        return None
    parts = [f"dim {d}: {a}..{b} of {n}" for d, a, b, n in slices]
    return "; ".join(parts)


def entry_lines(f: dict[str, Any]) -> list[str]:
    text = _slices_text(f)
    if text is None:
        return []
    return [f"the non-finite values sit only at these positions (the rest is finite): {text}"]


def _cache_like(f: dict[str, Any]) -> bool:
    name = str(f.get("name") or "").lower()
    return bool(f.get("bad_slices")) or any(w in name for w in _CACHE_WORDS)


def entry_next_steps(f: dict[str, Any]) -> list[str]:
    role = f.get("role")
    masked = (
        "masked-out positions still enter attention's products (weight 0 x NaN = NaN in every "
        "output), so a mask does not keep them out"
    )
    if role == "parameter":
        return [
            "the parameters diverged or were loaded broken: lower the learning rate, clip "
            "gradients, or reload the last good checkpoint",
            "an intended -inf parameter: pass its name to watch(..., allow=[...])",
        ]
    if role == "buffer":
        steps = []
        if _cache_like(f):
            steps.append(
                "a buffer is not trained: if it is a preallocated cache (a KV cache made with "
                f"torch.empty), fill it with zeros (torch.zeros, or cache.zero_() before use): {masked}"
            )
        else:
            steps.append(
                "a buffer is not trained: find where it was filled (a running statistic updated "
                "with a non-finite batch, a state dict loaded broken, torch.empty never written)"
            )
        steps.append("an intended -inf buffer (a mask): pass its name to watch(..., allow=[...])")
        return steps
    if _cache_like(f):  # a cache passed in is not data: its fix first, never "the batch"
        return [
            "a cache passed in (past key/values) with non-finite unused positions: fill it with "
            f"zeros where it is allocated (torch.zeros, not torch.empty): {masked}",
            "if it is data, not a cache: check the data pipeline",
        ]
    return ["check the data pipeline: the batch was already non-finite"]
