"""Faults on purpose: what silent data corruption looks like, made on demand, to prove a
guard catches it (the tests do; so can you, on your own model, before you trust it).

* :class:`GemmBitFlip`, a context manager: flip one bit of one element in the output of
  matching GEMMs (``aten.mm``/``addmm``/``bmm``/``baddbmm`` and the guarded
  ``cublas_guard::linear`` and its two backward GEMMs), as a faulty multiply unit would. Once
  (``times=1``: a transient fault), or on every matching call (``times=None``: a persistent
  fault; enter it on one rank only for a faulty GPU). Matches by op name and output shape,
  after ``skip`` matching calls.
* :func:`flip_bit`: flip one bit of one element of a tensor in place (a parameter on one
  replica, say).

>>> from cublas_guard_ext.training.fault_injection import GemmBitFlip, flip_bit
>>> with GemmBitFlip(shape=(8, 16), bit=27, times=1):      # the next GEMM giving [8, 16]
...     guard.step(closure)
>>> if rank == 1:
...     flip_bit(model.module.fc1.weight, index=5, bit=3)  # one replica's parameter

A dispatch mode (``TorchDispatchMode``): it sees ops below autograd, forward and backward,
and runs nothing on the device it was not asked to. Not for production runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["GemmBitFlip", "flip_bit", "spike_bit", "GEMM_OPS"]

# The ops whose results are GEMM outputs (by name as str(func) writes it, without the overload).
GEMM_OPS = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "cublas_guard.linear",
    "cublas_guard.linear_grad_input",
    "cublas_guard.linear_grad_weight",
)

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Where a float's exponent starts (its mantissa's width), by dtype.
_MANTISSA_BITS = {torch.float32: 23, torch.float64: 52, torch.bfloat16: 7, torch.float16: 10}


def flip_bit(t: torch.Tensor, index: int = 0, bit: int = 0) -> float:
    """Flip bit ``bit`` (0 = the lowest) of element ``index`` (of the flattened tensor) in
    place; returns the element's new value. A float32's exponent is bits 23-30, its sign 31."""
    if not 0 <= bit < 8 * t.element_size():
        raise ValueError(f"flip_bit: bit must be in [0, {8 * t.element_size()}) for {t.dtype}, got {bit}")
    flat = t.detach().view(-1)
    if not -flat.numel() <= index < flat.numel():
        raise ValueError(f"flip_bit: index {index} is outside a tensor of {flat.numel()} elements")
    word = flat.view(_INT_OF_SIZE[t.element_size()])
    mask = 1 << bit
    if t.element_size() > 1 and mask >= 1 << (8 * t.element_size() - 1):
        mask -= 1 << (8 * t.element_size())  # the sign bit, as the signed integer type holds it
    with torch.no_grad():
        word[index] ^= mask
    return float(flat[index])


def spike_bit(t: torch.Tensor, limit: float = 2.0**40) -> tuple[int, int] | None:
    """(index, bit) of the element and exponent bit whose flip makes the largest value that
    stays below ``limit`` in magnitude: the flip multiplies the element by 2**2, 2**4, 2**8 or
    2**16 (an exponent bit that is 0). A large *finite* spike, the kind a loss-spike detector
    should see: flipping the top exponent bit of a value near 1 gives ~1e38, which a squared
    loss turns into Inf. None when no element qualifies (float32/64, bfloat16, float16)."""
    shift = _MANTISSA_BITS.get(t.dtype)
    if shift is None or not t.numel():
        return None
    flat = t.detach().reshape(-1)
    words = flat.view(_INT_OF_SIZE[t.element_size()]).long()
    width = 8 * t.element_size() - 1 - shift
    exponent = (words >> shift) & ((1 << width) - 1)
    magnitude = flat.double().abs()
    best: tuple[float, int, int] | None = None
    for k in (4, 3, 2, 1):
        grown = magnitude * 2.0 ** (1 << k)
        ok = ((exponent >> k) & 1 == 0) & (exponent > 0) & (grown < limit) & torch.isfinite(grown)
        if bool(ok.any()):
            value, index = torch.where(ok, grown, torch.zeros_like(grown)).max(0)
            if best is None or float(value) > best[0]:
                best = (float(value), int(index), shift + k)
    return None if best is None else (best[1], best[2])


class GemmBitFlip(TorchDispatchMode):
    """Flip ``bit`` of element ``index`` in the output of matching GEMM calls.

    ``ops``: op names (``"aten.addmm"``, ``"cublas_guard.linear_grad_input"``; default every
    GEMM op in :data:`GEMM_OPS`); ``shape``: the output's shape, or None for any; ``skip``:
    matching calls let through first; ``times``: calls to corrupt (None: every one after
    ``skip``). ``bit="spike"``: instead of ``bit`` and ``index``, the first element and
    exponent bit whose flip multiplies the value by 2**16 or 2**8 and keeps it finite
    (:func:`spike_bit`). ``flips`` counts the calls corrupted, ``calls`` the matching calls seen, and
    ``values`` keeps each flipped element's value before and after.
    """

    def __init__(
        self,
        *,
        ops: Iterable[str] | None = None,
        shape: tuple[int, ...] | None = None,
        bit: int | str = 30,
        index: int = 0,
        skip: int = 0,
        times: int | None = 1,
    ) -> None:
        super().__init__()
        names = tuple(ops) if ops is not None else GEMM_OPS
        unknown = [n for n in names if n not in GEMM_OPS]
        if unknown:
            raise ValueError(f"GemmBitFlip: not GEMM ops: {unknown}; known: {', '.join(GEMM_OPS)}")
        self.ops = names
        self.shape = tuple(shape) if shape is not None else None
        self.bit, self.index, self.skip, self.times = bit, index, skip, times
        self.calls = 0
        self.flips = 0
        self.values: list[tuple[float, float]] = []

    def _matches(self, func: Any, out: Any) -> bool:
        name = str(func).rsplit(".", 1)[0] if str(func).count(".") >= 2 else str(func)
        if name not in self.ops or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return False
        return self.shape is None or tuple(out.shape) == self.shape

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._matches(func, out):
            self.calls += 1
            due = self.calls > self.skip and (self.times is None or self.flips < self.times)
            where = spike_bit(out) if self.bit == "spike" else (self.index, self.bit)
            if due and out.numel() and where is not None:
                index, bit = where
                before = float(out.reshape(-1)[index])
                after = flip_bit(out, index, int(bit))
                self.flips += 1
                self.values.append((before, after))
        return out
