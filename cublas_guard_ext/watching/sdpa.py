"""``F.scaled_dot_product_attention`` under watch: NaN/Inf only at masked-out key positions
(issue 47, point 3).

A preallocated KV cache's unused positions hold NaN (``torch.empty``); the mask excludes them,
yet SDPA's output turns NaN (0 x NaN). That NaN is not a birth (its inputs held NaN), so watch
would name the cache where it entered, or the next layer that refuses it, never the attention
that spread it. While a thread watches, global_patches.py routes ``F.scaled_dot_product_attention``
here: the call runs unchanged, then one fused finiteness read of its output (none in async mode
on a GPU: that read would synchronize; there the finding stays watch's own); only when that
finds NaN/Inf are the operands and the mask read, and if every non-finite key/value sits at a
key position the mask excludes for every query, :class:`NonFiniteMaskedKeysError` is raised at
the op, naming the module (the innermost watched module on the Python stack) and the operands
(a buffer or parameter of the model, or the caller's variable holding them).

Eager attention (``softmax(scores) @ v``) spreads a value cache's NaN the same way. While a block
holds a buffer that was non-finite on entry (a cache, judged by what it reaches),
``torch.matmul`` and ``Tensor.__matmul__``/``matmul``/``torch.bmm`` are routed through
:func:`check_matmul` (no patch, and no cost, otherwise): a product whose second operand shares that
buffer's storage, whose output holds NaN, and whose first operand (the weights) is finite and
exactly 0 wherever a value row is non-finite, is the same story, raised at the product.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch

from ..errors.masked_operands import NonFiniteMaskedKeysError

_native = sys.modules[__package__ + ".session"]._native
_local = threading.local()
OP = "aten::scaled_dot_product_attention"


def _models() -> list:
    if not hasattr(_local, "models"):
        _local.models = []
    return _local.models


def model_entered(model: torch.nn.Module | None, mode: str) -> None:
    """A watch block of this thread began (its model, if any, and its mode)."""
    _models().append((weakref.ref(model) if model is not None else None, mode, []))


def buffers_deferred(items: list[tuple[str, torch.Tensor]]) -> None:
    """The innermost block's buffers that were non-finite on entry (judged by what they reach)."""
    _models()[-1][2].extend(items)


def _deferred() -> list[tuple[str, torch.Tensor]]:
    return [item for entry in _models() for item in entry[2]]


def model_left(model: torch.nn.Module | None) -> None:
    models = _models()
    for i in range(len(models) - 1, -1, -1):
        ref = models[i][0]
        if (ref() if ref is not None else None) is model:
            del models[i]
            break


def _watched() -> list[torch.nn.Module]:
    return [m for m in (ref() for ref, _, _ in reversed(_models()) if ref is not None) if m is not None]


def _async() -> bool:
    models = _models()
    return bool(models) and models[-1][1] == "async"


def _allowed(attn_mask: Any, is_causal: bool, q: torch.Tensor, keys: int) -> tuple[torch.Tensor, str]:
    """Where each query may attend ([..., L, S] bool) and the words for the mask."""
    queries = q.shape[-2]
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=q.device)
    words = []
    if attn_mask is not None:
        m = attn_mask.detach()
        allowed = allowed & (m if m.dtype == torch.bool else m > float("-inf"))
        kind = "bool, False = masked" if m.dtype == torch.bool else f"{m.dtype}, -inf = masked"
        words.append(f"the attn_mask argument ({kind}, shape {list(m.shape)})")
    if is_causal:
        allowed = allowed & torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril()
        words.append("is_causal=True")
    return allowed, " and ".join(words) or "no mask"


def _name(t: torch.Tensor, what: str) -> str:
    for model in _watched():
        for kind, items in (("buffer", model.named_buffers()), ("parameter", model.named_parameters())):
            for name, p in items:
                if p is t:
                    return f"{what} {kind} '{name}'"
    frame = sys._getframe(3)
    while frame is not None:
        for name, value in frame.f_locals.items():
            if value is t and name not in ("key", "value", "k", "v"):
                return f"{what} '{name}'"
        frame = frame.f_back
    return f"the {what} operand"


def _module() -> str:
    ids = {}
    for model in _watched():
        ids.update({id(m): n for n, m in model.named_modules()})
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in ids:
            name = ids[id(owner)]
            return f"module '{name}'" if name else f"the watched model ({type(owner).__name__})"
        frame = frame.f_back
    return "no watched module (outside the model, or watch without one)"


def _counts(t: torch.Tensor, name: str) -> str | None:
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    return f"{name}: {nan} NaN, {inf} Inf" if nan or inf else None


def check(original: Any, args: tuple, kwargs: dict) -> Any:
    out = original(*args, **kwargs)
    if torch.compiler.is_compiling() or not _native._watch_active() or not isinstance(out, torch.Tensor):
        return out
    if not out.is_floating_point() or (out.device.type != "cpu" and _async()):
        return out  # async mode on a GPU reads nothing on the host: the entry finding stays
    if _native._watch_all_finite([out]):
        return out
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    given = dict(zip(names, args, strict=False)) | kwargs
    q, k, v = given.get("query"), given.get("key"), given.get("value")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return out
    with torch.no_grad():
        if not torch.isfinite(q).all() or k.dim() < 2 or v.dim() < 2:
            return out  # a non-finite query: not this story
        bad = (~torch.isfinite(k)).any(-1) | (~torch.isfinite(v)).any(-1)  # [..., S]
        if not bad.any():
            return out
        allowed, mask_words = _allowed(given.get("attn_mask"), bool(given.get("is_causal")), q, k.shape[-2])
        if (allowed & bad.unsqueeze(-2)).any():
            return out  # a non-finite value the mask lets in: watch's own finding names it
        hit = bad.reshape(-1, bad.shape[-1]).any(0).nonzero().flatten().tolist()
        counts = [c for c in (_counts(k, "key"), _counts(v, "value")) if c]
        operands = " and ".join(
            _name(t, what) for t, what in ((k, "key"), (v, "value")) if not torch.isfinite(t).all()
        )
        raise NonFiniteMaskedKeysError(
            op=OP,
            module=_module(),
            operands=operands,
            positions=hit,
            keys=int(k.shape[-2]),
            counts=counts,
            mask=mask_words,
            out_nan=int(torch.isnan(out).sum()),
            out_numel=out.numel(),
        )


def _masked_everywhere(m: torch.Tensor, keys: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per key position, masked for every query: (as True = masked, as False = masked) for a bool
    mask; a float mask's -inf (or a dtype's lowest value, transformers' choice) as the first."""
    if m.dim() == 0 or m.shape[-1] != keys:
        return None
    rows = m.detach().reshape(-1, keys)
    if m.dtype == torch.bool:
        return rows.all(0), (~rows).all(0)
    if m.is_floating_point():  # an additive mask holds 0 and -inf only (scores hold more)
        low = rows <= torch.finfo(m.dtype).min / 2
        if not bool(((rows == 0) | low).all()):
            return None
        return low.all(0), torch.zeros_like(low[0])
    return None


def _eager_mask(weights: torch.Tensor, values: torch.Tensor, bad: torch.Tensor) -> str:
    """The caller's mask variable that excludes every bad key position, if one is in sight."""
    keys = int(bad.shape[-1])
    bad_keys = bad.reshape(-1, keys).any(0)
    frame = sys._getframe(3)
    for _ in range(4):
        if frame is None:
            break
        for name, m in frame.f_locals.items():
            if not isinstance(m, torch.Tensor) or m is weights or m is values:
                continue
            masked = _masked_everywhere(m, keys)
            if masked is None:
                continue
            for polarity, everywhere in zip(("True", "False"), masked, strict=True):
                if bool(everywhere.any()) and not bool((bad_keys & ~everywhere).any()):
                    kind = (
                        f"bool, {polarity} = masked" if m.dtype == torch.bool else f"{m.dtype}, -inf = masked"
                    )
                    return f"the mask '{name}' ({kind}, shape {list(m.shape)}), applied before the softmax,"
        frame = frame.f_back
    return "the mask applied before the softmax (it left those weights exactly 0)"


def check_matmul(original: Any, args: tuple, kwargs: dict) -> Any:
    out = original(*args, **kwargs)
    deferred = _deferred()
    if not deferred or len(args) < 2 or not isinstance(out, torch.Tensor):
        return out
    weights, values = args[0], args[1]
    if not isinstance(weights, torch.Tensor) or not isinstance(values, torch.Tensor) or values.dim() < 2:
        return out
    storage = values.untyped_storage().data_ptr()
    name = next((n for n, t in deferred if t.untyped_storage().data_ptr() == storage), None)
    if name is None or torch.compiler.is_compiling() or not _native._watch_active():
        return out
    if not out.is_floating_point() or (out.device.type != "cpu" and _async()):
        return out
    if _native._watch_all_finite([out]):
        return out
    with torch.no_grad():
        if weights.dim() < 2 or not torch.isfinite(weights).all():
            return out  # NaN weights (a fully masked row's softmax): not this story
        bad = (~torch.isfinite(values)).any(-1)  # [..., S]: the value rows holding NaN/Inf
        if not bad.any() or ((weights != 0) & bad.unsqueeze(-2)).any():
            return out  # a weight on a non-finite value: nothing masked it
        raise NonFiniteMaskedKeysError(
            op="aten::matmul",
            module=_module(),
            operands=f"value buffer '{name}'",
            positions=bad.reshape(-1, bad.shape[-1]).any(0).nonzero().flatten().tolist(),
            keys=int(values.shape[-2]),
            counts=[c for c in (_counts(values, "value"),) if c],
            mask=_eager_mask(weights, values, bad),
            out_nan=int(torch.isnan(out).sum()),
            out_numel=out.numel(),
        )
