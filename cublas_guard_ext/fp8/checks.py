"""What is checked of one float8 operand, and how the verdict is raised.

One operand = a high-precision tensor ``x``, its ``amax`` (what dynamic scaling reads anyway),
its ``scale`` and the float8 codes the cast made. The fast path reads nothing ``x``-sized that
scaling does not read already, but one ``count_nonzero(x)``:

* non-finite values: ``amax`` is NaN or Inf exactly when ``x`` holds one (max propagates both), so
  the amax scaling computed is the check; the NaN/+Inf/-Inf counts and the first bad element
  (the project's fused scan, ``cublas_guard_ext.scan``) are read only on that error path;
* the scale: finite, > 0, reciprocal finite (a scalar or one value per row);
* saturation: ``amax * scale`` above ``max`` plus half the format's top spacing (per row) says
  whether any value is clipped; only then is ``|x * scale|`` counted against it (never, with
  scales computed from this amax: their rounding error stays under it);
* flush to zero: the zero codes of the cast (one byte per value) minus the zeros of ``x``: exactly
  the values the cast rounded to 0; ``x``'s zeros are counted only when the zero codes alone could
  cross the threshold (:func:`flush_counts`). With tensorwise scaling the amax itself is read in
  one ``aminmax`` pass (fp8/linear.py) instead of torchao's abs + max: the checks fit in what that
  saves.

Each check yields a small stats tensor on ``x``'s device; ``sync`` mode reads it at once (one
host read per operand), ``async`` mode keeps it and reads it at the next guarded float8 call or
:func:`check` (its copy is started without blocking), ``off`` checks nothing.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..capsule import scaled as _scaled_capsule
from ..errors.fp8 import Fp8NonFiniteError, Fp8RangeError, Fp8RangeWarning, Fp8ScaleError, range_message
from .formats import THRESHOLDS, Format

_quiet = threading.local()
# Called with (where, saturated fraction, flushed fraction) for every operand checked in full.
OBSERVERS: list = []


@contextmanager
def inside_checked_gemm() -> Iterator[None]:
    """A guarded float8 layer's GEMM is running on this thread: its casts and scaled GEMMs are
    checked there, with the layer's name, not again by fp8/direct.py."""
    previous = getattr(_quiet, "on", False)
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = previous


def is_quiet() -> bool:
    return getattr(_quiet, "on", False)


@dataclass
class Where:
    """Where an operand was checked: a layer's GEMM (``layer``, ``gemm``) or a direct op (``op``)."""

    operand: str
    layer: str | None = None
    gemm: str | None = None
    op: str | None = None
    recipe: str | None = None

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class Pending:
    where: Where
    x: torch.Tensor
    amax: torch.Tensor
    scale: torch.Tensor
    fmt: Format
    stats: torch.Tensor
    event: Any = None  # async on CUDA: the stats' copy to the host, recorded


# stats layout: [amax all finite, scale values bad, zero codes (+0 or -0), any row saturates]
def stats_of(
    x: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor, codes: torch.Tensor, fmt: Format
) -> torch.Tensor:
    with torch.no_grad():
        scale32 = scale.float()
        bad_scale = ~(torch.isfinite(scale32) & (scale32 > 0) & torch.isfinite(scale32.reciprocal()))
        parts = (
            torch.isfinite(amax).all(),
            bad_scale.sum(),
            # +0 and -0 (0x00, 0x80) are the int8 values v with 2v = 0 (mod 256): one cheap pass
            codes.numel() - torch.count_nonzero(codes.view(torch.int8) * 2),
            (amax.float() * scale32 > fmt.clipped_above).any(),
        )
        return torch.stack([torch.as_tensor(p).to(torch.float64) for p in parts])


def flush_counts(x: torch.Tensor, zero_codes: int, exact: bool) -> tuple[int, int]:
    """(values the cast flushed to zero, nonzero values of ``x``). The flushed are at most the zero
    codes, so while those stay under ``flush / (1 + flush)`` of the values the fraction cannot
    cross the threshold and ``x`` is not read again (unless ``exact``): (0, -1) then."""
    numel, limit = x.numel(), THRESHOLDS.flush
    if not exact and zero_codes <= numel * limit / (1 + limit):
        return 0, -1
    nonzero = int(torch.count_nonzero(x.detach()))
    return max(nonzero - (numel - zero_codes), 0), nonzero


def _scan_counts(x: torch.Tensor) -> dict[str, Any]:
    """NaN/+Inf/-Inf counts and the first bad element, by the project's fused scan."""
    from ..guarded_linear.ops import scan

    flat = x.detach()
    if flat.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        flat = flat.float()
    result = scan(flat)
    counts = {
        "nan_count": result.nan_count,
        "posinf_count": result.posinf_count,
        "neginf_count": result.neginf_count,
    }
    index = int(result.tensor.tolist()[3])
    if index >= 0:
        counts["first_bad_index"] = index
        counts["first_bad_value"] = str(float(flat.reshape(-1)[index]))
    return counts


def _scalar_fields(amax: torch.Tensor, scale: torch.Tensor) -> dict[str, Any]:
    if amax.numel() == 1:
        return {"amax": float(amax.reshape(())), "scale": float(scale.reshape(()))}
    a = amax.float()
    finite = a[torch.isfinite(a)]
    out: dict[str, Any] = {
        "amax": float(a.max()),
        "scale_min": float(scale.float().min()),
        "scale_max": float(scale.float().max()),
    }
    if finite.numel():
        out["amax_min"] = float(finite.min())
    return out


def verdict(p: Pending, host: list[float], warned: set | None = None) -> None:
    """Raise (or warn) what ``host`` (the stats read back) says of the operand ``p``."""
    finite, bad_scale, zero_codes, overflows = host
    where = p.where.fields()
    base = {
        **where,
        "fp8_dtype": p.fmt.name,
        "numel": p.x.numel(),
        "shape": list(p.x.shape),
        "dtype": str(p.x.dtype),
    }
    if not finite:
        raise Fp8NonFiniteError(**base, **_scan_counts(p.x), **_scalar_fields(p.amax, p.scale))
    if bad_scale:
        s = p.scale.detach().float().reshape(-1)
        bad = ~(torch.isfinite(s) & (s > 0) & torch.isfinite(s.reciprocal()))
        first = int(bad.nonzero()[0, 0])
        raise Fp8ScaleError(
            **where,
            fp8_dtype=p.fmt.name,
            bad_count=int(bad_scale),
            count=s.numel(),
            first_bad_index=first,
            first_bad_value=str(float(s[first])),
            **_scalar_fields(p.amax, p.scale),
        )
    saturated = 0
    if overflows:
        scaled = (p.x.detach().float() * p.scale.float()).abs()
        saturated = int(torch.count_nonzero(scaled > p.fmt.clipped_above))
    flushed, nonzero = flush_counts(p.x, int(zero_codes), exact=bool(OBSERVERS))
    numel = max(p.x.numel(), 1)
    sat_fraction, flush_fraction = saturated / numel, flushed / max(nonzero, 1)
    for observer in OBSERVERS:  # benchmarks/fp8_bench.py --ranges: what clean training measures
        observer(p.where, sat_fraction, flush_fraction)
    if sat_fraction <= THRESHOLDS.saturate and flush_fraction <= THRESHOLDS.flush:
        return
    fields = {
        **base,
        **_scalar_fields(p.amax, p.scale),
        "saturated": saturated,
        "saturated_fraction": sat_fraction,
        "flushed": flushed,
        "nonzero": int(nonzero),
        "flushed_fraction": flush_fraction,
        "fp8_max": p.fmt.max,
        "fp8_tiny": p.fmt.tiny,
        "saturate_limit": THRESHOLDS.saturate,
        "flush_limit": THRESHOLDS.flush,
    }
    if THRESHOLDS.strict:
        raise Fp8RangeError(**fields)
    key = (p.where.layer, p.where.op, p.where.gemm, p.where.operand)
    if warned is not None:
        if key in warned:
            return
        warned.add(key)
    warnings.warn(Fp8RangeWarning(range_message(fields)), stacklevel=4)


def _verdict_with_capsule(p: Pending, host: list[float], warned: set | None) -> None:
    """:func:`verdict`; a guarded layer's refused operand also writes its capsule (the direct
    calls write theirs around the whole scaled GEMM, fp8/direct.py)."""
    try:
        verdict(p, host, warned)
    except (Fp8NonFiniteError, Fp8ScaleError) as err:
        if p.where.layer is not None and p.where.op is None:
            where = {**p.where.fields(), "fp8_dtype": p.fmt.name}
            _scaled_capsule.attach(err, _scaled_capsule.capture_cast(err, p.x, p.amax, p.scale, where))
        raise


class Checker:
    """The checks of one guarded layer (or of direct calls): sync now, async later, off never."""

    def __init__(self) -> None:
        self.pending: list[Pending] = []
        self.warned: set = set()

    def operand(
        self,
        mode: str,
        where: Where,
        x: torch.Tensor,
        amax: torch.Tensor,
        scale: torch.Tensor,
        codes: torch.Tensor,
        fmt: Format,
    ) -> None:
        if mode == "off":
            return
        stats = stats_of(x, amax, scale, codes, fmt)
        p = Pending(where, x, amax, scale, fmt, stats)
        if mode == "sync":
            _verdict_with_capsule(p, stats.tolist(), self.warned)
            return
        if stats.device.type != "cpu":
            p.stats = stats.to("cpu", non_blocking=True)
            p.event = torch.cuda.Event()
            p.event.record()
        self.pending.append(p)

    def check(self, wait: bool = False) -> None:
        """Read the async stats whose copies have landed (all of them when ``wait``); raise the first
        failure. A host synchronization only when ``wait`` and a copy is still on its way."""
        keep = []
        pending, self.pending = self.pending, []
        try:
            for p in pending:
                if p.event is not None and not wait and not p.event.query():
                    keep.append(p)
                    continue
                if p.event is not None:
                    p.event.synchronize()
                _verdict_with_capsule(p, p.stats.tolist(), self.warned)
        finally:
            self.pending = keep + self.pending
