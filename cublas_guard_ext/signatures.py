"""Order-sensitive signatures of tensors, folded on the device with no host sync.

Two replicas of a model hold bitwise-equal parameters; a rerun of a deterministic step
computes bitwise-equal activations. A signature is what two ranks (or two runs) exchange
instead of the tensors: one int64 per tensor that changes when any bit of any element
changes, and when elements trade places.

Why not ``torch.hash_tensor``: it XORs the elements (upcast to 64 bits), so it cannot see a
permutation (two rows written in each other's place) and two equal flips cancel. Why not a
float sum or norm: rounding absorbs a flip of a low mantissa bit, and the result depends on
the order of the reduction (thread counts, kernels), so bitwise-equal replicas could disagree.

The fold: the tensor's bytes read as int64 words ``x_i`` (a tail shorter than a word is
widened byte by byte), laid out as ``[rows, LANES]``; the signature is
``sum_i x_i * (w[i % LANES] + v[i // LANES])`` modulo 2**64, with ``w`` fixed random odd
and ``v`` fixed random even 64-bit weights (so every position's weight is odd): computed as
the lane sums (``sum(0)``) times ``w`` plus the row sums (``sum(1)``) times ``v``. Integer
sums wrap exactly and do not depend on the order the kernel adds in, so the same bytes give
the same signature on any device, thread count or kernel; a single flipped bit changes it
always (the word changes by +-2**k, times an odd weight: never 0 modulo 2**64); a
transposition of two different words changes it unless
``(x_i - x_j) * (W_j - W_i)`` is 0 modulo 2**64 (random weights: about 2**-64 for words
differing in their low bits). Both passes are native-width int64 reductions, the fastest
integer reductions torch has on the CPU: 11-14 ms for all-MiniLM-L6-v2's 22.7M float32
parameters on one core (a widening int32 -> int64 sum takes ~150 ms; an int8 ``_int_mm``
projection ~31 ms; a per-element weighted sum ~77 ms). LANES = 16: ``sum(0)`` over 16 int64
lanes vectorises best (6 ms; 8 and 32 lanes take 24 and 13 ms).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

__all__ = ["LANES", "fold", "fold_many", "stats", "combine"]

LANES = 16
_SEED = 0x5DC_0DD  # fixed: every process must draw the same weights
_weights: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _random_weights(n: int, seed: int, odd: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    hi = torch.randint(0, 1 << 31, (n,), generator=gen, dtype=torch.int64)
    lo = torch.randint(0, 1 << 32, (n,), generator=gen, dtype=torch.int64)
    w = (hi << 32) | lo
    return w | 1 if odd else w & ~1


def _weights_for(device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lane weights and at least ``rows`` row weights on ``device`` (cached, grown by
    doubling; the first ``n`` row weights never change when the table grows)."""
    key = (device, 0)
    cached = _weights.get(key)
    if cached is None or cached[1].numel() < rows:
        size = max(1024, 1 << max(rows - 1, 1).bit_length())
        lanes = _random_weights(LANES, _SEED, odd=True)
        row_w = torch.cat(
            [_random_weights(1024, _SEED + 1 + b, odd=False) for b in range(max(1, size // 1024))]
        )
        cached = (lanes.to(device), row_w.to(device))
        _weights[key] = cached
    return cached


def _words(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tensor's bytes as int64 words, and the tail bytes (widened to int64) or None."""
    if hasattr(t, "to_local"):  # a DTensor: this rank's shard
        t = t.to_local()
    t = t.detach()
    if t.is_sparse:
        t = t.coalesce().values()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    flat = t.reshape(-1)
    if flat.element_size() == 8:
        return flat.view(torch.int64), None
    raw = flat.view(torch.uint8)
    n = raw.numel() // 8 * 8
    if n and (flat.storage_offset() * flat.element_size()) % 8 != 0:
        raw = raw.clone()  # a view starting off an 8-byte boundary cannot be read as int64
    words = raw[:n].view(torch.int64) if n else raw.new_zeros(0, dtype=torch.int64)
    tail = raw[n:].to(torch.int64) if raw.numel() > n else None
    return words, tail


def fold(t: torch.Tensor) -> torch.Tensor:
    """The signature of ``t``: a 0-d int64 tensor on its device (no host sync). Equal bytes
    (same dtype, same shape) give equal signatures everywhere; see the module docstring."""
    words, tail = _words(t)
    rows = words.numel() // LANES
    lanes_w, rows_w = _weights_for(words.device, rows + 2)
    sig = torch.zeros((), dtype=torch.int64, device=words.device)
    if rows:
        grid = words[: rows * LANES].view(rows, LANES)
        sig = sig + (grid.sum(0) * lanes_w).sum() + (grid.sum(1) * rows_w[:rows]).sum()
    rest = words[rows * LANES :]
    if rest.numel():
        sig = sig + (rest * (lanes_w[: rest.numel()] + rows_w[rows])).sum()
    if tail is not None:
        sig = sig + (tail * (lanes_w[: tail.numel()] + rows_w[rows + 1])).sum()
    # the shape and dtype are part of what two copies must agree on (crc32: Python's str
    # hash differs between processes)
    return sig + zlib.crc32(f"{tuple(t.shape)} {t.dtype}".encode())


def fold_many(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One int64 signature per tensor, stacked: ``[n]`` on the first tensor's device."""
    sigs = [fold(t) for t in tensors]
    if not sigs:
        return torch.zeros(0, dtype=torch.int64)
    device = sigs[0].device
    return torch.stack([s.to(device, non_blocking=True) for s in sigs])


def combine(sigs: torch.Tensor) -> torch.Tensor:
    """Fold a vector of signatures into one, order-sensitively (0-d int64)."""
    if not sigs.numel():
        return torch.zeros((), dtype=torch.int64, device=sigs.device)
    _, rows_w = _weights_for(sigs.device, sigs.numel())
    return (sigs.reshape(-1) * (rows_w[: sigs.numel()] + 1)).sum()  # odd weights


def stats(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ints, floats)`` of a floating tensor, on its device, no host sync: ints is
    ``[signature, non-finite count]`` (int64), floats is ``[finite absmax, 2-norm of the
    finite values]`` (float64). A reruns' per-module comparison reads these."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    t = t.detach()
    sig = fold(t)
    if not t.is_floating_point() or not t.numel():
        zero = torch.zeros((), dtype=torch.int64, device=t.device)
        return torch.stack([sig, zero]), torch.zeros(2, dtype=torch.float64, device=t.device)
    finite = torch.isfinite(t)
    bad = (~finite).sum()
    clean = torch.where(finite, t, torch.zeros((), dtype=t.dtype, device=t.device)).double()
    floats = torch.stack([clean.abs().max(), torch.linalg.vector_norm(clean)])
    return torch.stack([sig, bad]), floats
