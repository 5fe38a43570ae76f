"""A NaN born from inputs that held +/-Inf but no NaN: the lines of watch's finding.

watch's rule (csrc/locked/watch/watch_device_logic.h, ``kTagInf``) makes such a NaN a birth: the
infinities were intended (a ``masked_fill(..., -inf)`` mask, a mask made before the block) but
the NaN is new. The ops named here never make a NaN from finite values, so a NaN birth at one of
them says its inputs held infinities: a softmax over a row whose every score is -inf (a query
with every key masked: 0/0), ``x - x`` or ``inf + (-inf)``, ``0 * inf``. Plain numbers from the
finding's fields: the rows are counted from the NaN count and the output's last dimension.
"""

from __future__ import annotations

from typing import Any

_SOFTMAX = ("softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax")
_ARITH = {
    "sub": "a difference of two infinities of the same sign (x - x where x is Inf)",
    "rsub": "a difference of two infinities of the same sign (x - x where x is Inf)",
    "add": "a sum of +Inf and -Inf",
    "mul": "a product of zero and an infinity (0 * Inf), e.g. a 0/1 mask times a -inf mask",
    "addcmul": "a product of zero and an infinity (0 * Inf)",
}


def _base(op: Any) -> str:
    parts = str(op or "").split(".")
    return (parts[1] if len(parts) > 1 else "").rstrip("_")


def applies(f: dict[str, Any]) -> bool:
    """A NaN birth at an op that makes NaN only from infinities."""
    if not f.get("nan_count"):
        return False
    base = _base(f.get("op"))
    return base in _SOFTMAX or base in _ARITH


def _rows(f: dict[str, Any]) -> tuple[int, int, list[int] | None] | None:
    """(NaN rows, all rows, the first NaN row's coordinates) when the NaN fills whole rows of
    the last dimension (a softmax over a row of -inf is NaN everywhere in it)."""
    shape = list(f.get("shape") or [])
    if not shape or not shape[-1] or int(f["nan_count"]) % int(shape[-1]):
        return None
    total = 1
    for size in shape[:-1]:
        total *= int(size)
    coords = f.get("first_bad_coords")
    return int(f["nan_count"]) // int(shape[-1]), total, (list(coords[:-1]) if coords else None)


def headline_tail() -> str:
    return "from inputs that held Inf but no NaN"


def details(f: dict[str, Any]) -> list[str]:
    base = _base(f.get("op"))
    if base not in _SOFTMAX:
        return [f"the NaN is {_ARITH[base]}: the Inf came in intended (a mask), the NaN is new"]
    lines = []
    rows = _rows(f)
    where = f" in module '{f['module']}'" if f.get("module") else ""
    if rows is None:
        lines.append(
            f"a softmax{where} over rows whose every score was -inf: exp(-inf) sums to 0, and 0/0 is NaN"
        )
        return lines
    bad, total, first = rows
    shape = list(f.get("shape") or [])
    if len(shape) == 4:
        label = "(batch, head, query)"
        text = f"{bad} of {total} {label} rows had every key masked"
    else:
        label = "row"
        text = f"{bad} of {total} rows had every score -inf"
    if first is not None:
        text += f"; the first at {label} ({', '.join(str(c) for c in first)})"
    lines.append(text + f" (NaN {f['nan_count']} = {bad} rows x {shape[-1]} keys)")
    lines.append(
        f"a softmax{where} over a row of -inf is 0/0 = NaN: a query with nothing to attend to (left "
        "padding with a causal mask, a sequence whose every key is padding); pytorch#41508"
    )
    return lines


def next_steps(f: dict[str, Any]) -> list[str]:
    base = _base(f.get("op"))
    if base not in _SOFTMAX:
        return [
            "mask with where() instead of arithmetic on infinities: x.masked_fill(mask, float('-inf')) once, "
            "not mask * -inf or a difference of masked values"
        ]
    return [
        "give every query a key: fill masked scores with torch.finfo(scores.dtype).min instead of -inf "
        "(a fully masked row then averages its values instead of NaN), or unmask fully masked rows as "
        "transformers' _unmask_unattended does",
        "or use F.scaled_dot_product_attention with the mask: since torch 2.5 it returns 0 for a query "
        "with every key masked; the padded queries' outputs are discarded by the loss anyway",
    ]
