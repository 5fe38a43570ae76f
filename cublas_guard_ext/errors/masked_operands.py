"""NaN/Inf only at the masked-out key positions of an attention's operands (issue 47, point 3).

A KV cache preallocated with ``torch.empty`` (or filled earlier with NaN) holds non-finite values
in the positions not written yet; the attention mask excludes them, but
``scaled_dot_product_attention`` still multiplies them: a masked score becomes -inf, its weight
0, and 0 x NaN is NaN, so every output turns NaN. watching/sdpa.py finds this at the SDPA op (the
op whose output is the first NaN) and raises :class:`NonFiniteMaskedKeysError`.
"""

from __future__ import annotations

from .base import GuardError


def _ranges(positions: list[int]) -> str:
    """[4, 5, 6, 9] -> '4..6, 9'."""
    parts, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            parts.append(f"{start}..{p}" if p != start else f"{p}")
            start = None
    return ", ".join(parts)


class NonFiniteMaskedKeysError(GuardError, ValueError):
    """watch: an attention's key/value operand held NaN/Inf only at key positions its mask
    excludes for every query, and the output turned NaN anyway (0 x NaN = NaN)."""

    kind = "non_finite_masked_keys"

    def _headline(self) -> str:
        f = self.fields
        return (
            f"watch: {f.get('op')} in {f.get('module')} made {f.get('out_nan')} NaN of "
            f"{f.get('out_numel')} output values from {f.get('operands')} whose non-finite values sit "
            "only at masked-out key positions"
        )

    def _details(self) -> list[str]:
        f = self.fields
        positions = list(f.get("positions") or [])
        return [
            f"key positions {_ranges(positions)} of {f.get('keys')} hold NaN/Inf "
            f"({'; '.join(f.get('counts') or [])}); every other key position is finite",
            f"{f.get('mask')} excludes those positions for every query: they were never meant to count",
            "masked positions still enter the product: their score becomes -inf and their weight 0, "
            "and 0 x NaN = NaN, so every output that sums over them is NaN",
        ]

    def _next_steps(self) -> list[str]:
        return [
            "fill the cache with zeros where it is allocated (torch.zeros, not torch.empty; or "
            "cache.zero_() before its first use): zeros at masked positions change nothing",
            "or pass the attention only the positions written (cache[:, :, :length])",
        ]
