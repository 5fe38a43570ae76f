"""Order-sensitive signatures of tensors, folded on the device with no host sync.

Two replicas of a model hold bitwise-equal parameters; a rerun of a deterministic step
computes bitwise-equal activations. A signature is what two ranks (or two runs) exchange
instead of the tensors: one int64 per tensor that changes when any bit of any element
changes, and when elements trade places.

Why not ``torch.hash_tensor``: it XORs the elements (upcast to 64 bits), so it cannot see a
permutation (two rows written in each other's place) and two equal flips cancel. Why not a
float sum or norm: rounding absorbs a flip of a low mantissa bit, and the result depends on
the order of the reduction (thread counts, kernels), so bitwise-equal replicas could disagree.

The fold: the tensor's bytes, zero-padded to whole rows of ``LANES`` int64 words, read as
words ``x_i`` laid out as ``[rows, LANES]``; the signature is
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
from collections.abc import Iterable, Sequence

import torch

__all__ = ["LANES", "ROW_BYTES", "fold", "fold_many", "Folder", "stats", "combine"]

LANES = 16
ROW_BYTES = 8 * LANES
SMALL_BYTES = 64 << 10  # tensors below this are folded together in one batch
_SEED = 0x5DC_0DD  # fixed: every process must draw the same weights
_weights: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _random_weights(n: int, seed: int, odd: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    hi = torch.randint(0, 1 << 31, (n,), generator=gen, dtype=torch.int64)
    lo = torch.randint(0, 1 << 32, (n,), generator=gen, dtype=torch.int64)
    w = (hi << 32) | lo
    return w | 1 if odd else w & ~1


def _weights_for(device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lane weights (odd) and at least ``rows`` row weights (even) on ``device``
    (cached, grown by doubling; the first ``n`` row weights never change when it grows)."""
    cached = _weights.get(device)
    if cached is None or cached[1].numel() < rows:
        size = max(1024, 1 << max(rows - 1, 1).bit_length())
        lanes = _random_weights(LANES, _SEED, odd=True)
        row_w = torch.cat([_random_weights(1024, _SEED + 1 + b, odd=False) for b in range(size // 1024)])
        cached = (lanes.to(device), row_w.to(device))
        _weights[device] = cached
    return cached


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes are folded: a DTensor's local shard, detached, dense, contiguous."""
    if hasattr(t, "to_local"):  # a DTensor: this rank's shard
        t = t.to_local()
    t = t.detach()
    if t.is_sparse:
        t = t.coalesce().values()
    return t if t.is_contiguous() else t.contiguous()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, flat (uint8); a copy only when they do not start on an 8-byte
    boundary (an int64 view needs one)."""
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8, device=t.device)
    if (t.storage_offset() * t.element_size()) % 8 != 0:
        raw = raw.clone()
    return raw


def _stamp(t: torch.Tensor) -> int:
    """What two copies must also agree on: shape and dtype (crc32: Python's str hash differs
    between processes)."""
    return zlib.crc32(f"{tuple(t.shape)} {t.dtype}".encode())


def fold(t: torch.Tensor) -> torch.Tensor:
    """The signature of ``t``: a 0-d int64 tensor on its device (no host sync). Equal bytes
    (same dtype, same shape) give equal signatures everywhere; see the module docstring."""
    return Folder([t])()[0]


def fold_many(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One int64 signature per tensor, stacked: ``[n]`` (each the same as :func:`fold`'s)."""
    tensors = list(tensors)
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    return Folder(tensors)()


class Folder:
    """Fold a fixed list of tensors (a model's parameters) again and again: ``folder()`` is the
    ``[n]`` int64 signatures, on the first tensor's device, with no host sync. The plan (which
    tensors are batched, their row offsets) is made once; the large tensors' int64 views are
    cached while a tensor keeps its storage."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.n = len(self.tensors)
        self._plan: tuple | None = None
        self._views: dict[int, tuple[tuple, torch.Tensor]] = {}

    def _make_plan(self, locals_: list[torch.Tensor]) -> tuple:
        device = locals_[0].device if locals_ else torch.device("cpu")
        small = [
            i
            for i, t in enumerate(locals_)
            if t.numel() * t.element_size() < SMALL_BYTES and t.device == device
        ]
        big = [i for i in range(len(locals_)) if i not in set(small)]
        segments, positions, offset = [], [], 0
        pads = []
        for i in small:
            nbytes = locals_[i].numel() * locals_[i].element_size()
            rows = -(-nbytes // ROW_BYTES)
            pads.append(rows * ROW_BYTES - nbytes)
            segments.append(torch.full((rows,), small.index(i), dtype=torch.int64))
            positions.append(torch.arange(rows, dtype=torch.int64))
            offset += rows
        _, rows_w = _weights_for(device, max([int(p.numel()) for p in positions] + [1]) + 1)
        seg = torch.cat(segments).to(device) if segments else None
        row_weights = rows_w[torch.cat(positions).to(device)] if positions else None
        stamps = torch.tensor([_stamp(t) for t in locals_], dtype=torch.int64, device=device)
        zeros = torch.zeros(ROW_BYTES, dtype=torch.uint8, device=device)
        return device, small, big, seg, row_weights, pads, stamps, zeros

    def _grid(self, i: int, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the whole rows as an int64 [rows, LANES] view, the last partial row zero-padded or None)."""
        key = (t.data_ptr(), t.numel(), t.dtype)
        cached = self._views.get(i)
        if cached is not None and cached[0] == key:
            return cached[1], None
        raw = _bytes(t)
        full = raw.numel() // ROW_BYTES
        grid = raw[: full * ROW_BYTES].view(torch.int64).view(full, LANES)
        rest = raw[full * ROW_BYTES :]
        part = None
        if rest.numel():
            part = torch.cat(
                [rest, torch.zeros(ROW_BYTES - rest.numel(), dtype=torch.uint8, device=raw.device)]
            )
            part = part.view(torch.int64)
        if part is None and (t.storage_offset() * t.element_size()) % 8 == 0:
            self._views[i] = (key, grid)  # a view of the tensor itself: valid while its storage is
        return grid, part

    def __call__(self) -> torch.Tensor:
        locals_ = [_local(t) for t in self.tensors]
        if self._plan is None:
            self._plan = self._make_plan(locals_)
        device, small, big, seg, row_weights, pads, stamps, zeros = self._plan
        lanes_w, rows_w = _weights_for(device, 1)
        out = torch.zeros(self.n, dtype=torch.int64, device=device)
        if small:
            pieces = []
            for i, pad in zip(small, pads, strict=True):
                pieces.append(_bytes(locals_[i]))
                if pad:
                    pieces.append(zeros[:pad])
            grid = torch.cat(pieces).view(torch.int64).view(-1, LANES)
            lanes = torch.zeros(len(small), LANES, dtype=torch.int64, device=device).index_add_(0, seg, grid)
            rows = torch.zeros(len(small), dtype=torch.int64, device=device).index_add_(
                0, seg, grid.sum(1) * row_weights
            )
            out[small] = (lanes * lanes_w).sum(1) + rows
        for i in big:
            grid, part = self._grid(i, locals_[i])
            full = grid.shape[0]
            _, rows_w = _weights_for(device, full + 1)
            sig = (grid.sum(0) * lanes_w).sum() + (grid.sum(1) * rows_w[:full]).sum()
            if part is not None:
                sig = sig + (part * (lanes_w + rows_w[full])).sum()
            out[i] = sig.to(device)
        return out + stamps


def combine(sigs: torch.Tensor) -> torch.Tensor:
    """Fold a vector of signatures into one, order-sensitively (0-d int64)."""
    if not sigs.numel():
        return torch.zeros((), dtype=torch.int64, device=sigs.device)
    _, rows_w = _weights_for(sigs.device, sigs.numel())
    return (sigs.reshape(-1) * (rows_w[: sigs.numel()] + 1)).sum()  # odd weights


def stats(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ints, floats)`` of a tensor, on its device, no host sync: ints is ``[signature,
    non-finite count]`` (int64), floats is ``[finite absmax, 2-norm of the finite values]``
    (float64). The reruns' per-module comparison reads these."""
    t = _local(t)
    sig = fold(t)
    if not t.is_floating_point() or not t.numel():
        zero = torch.zeros((), dtype=torch.int64, device=t.device)
        return torch.stack([sig, zero]), torch.zeros(2, dtype=torch.float64, device=t.device)
    finite = torch.isfinite(t)
    bad = (~finite).sum()
    clean = torch.where(finite, t, torch.zeros((), dtype=t.dtype, device=t.device)).double()
    floats = torch.stack([clean.abs().max(), torch.linalg.vector_norm(clean)])
    return torch.stack([sig, bad]), floats
