"""Direct FP8 calls checked: ``torch._scaled_mm``, ``F.scaled_mm``, ``torch._scaled_grouped_mm``
and every ``Tensor.to`` a float8 dtype, inside :func:`checked_fp8` (``run`` keeps it on).

A scaled GEMM is checked before it runs (the operands' layout for cuBLASLt, the float8 dtypes the
device has, NaN/Inf codes in the operands, the scales finite and > 0 and shaped for a recipe) and
after (non-finite outputs, by the project's scan). A cast is checked after it ran, before its
result is returned: non-finite values in its input (e4m3 saturates +Inf to 448: the cast is where
an Inf disappears) and how many values saturated or flushed to zero. Every check reads its verdict
on the host (sync), whatever the guard mode: these are explicit diagnostics. Inside a guarded
Float8Linear's GEMM (fp8/linear.py) nothing is checked twice. Under ``torch.compile`` the checks
step aside (the originals run).
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from ..capsule import scaled as _scaled_capsule
from ..errors.fp8 import ARGUMENT_TEXTS as TEXTS
from ..errors.fp8 import (
    Fp8ArgumentError,
    Fp8NonFiniteError,
    Fp8RangeError,
    Fp8RangeWarning,
    Fp8ScaleError,
    range_message,
)
from .checks import _scan_counts, is_quiet
from .formats import FORMATS, THRESHOLDS, Format

_lock = threading.Lock()
_installed: dict[str, Any] = {}
_depth = [0]
_WARNED: set = set()


def device_lacks(dtype: torch.dtype, device_type: str, hip: str | None, arch: Any) -> str | None:
    """Why a scaled GEMM of ``dtype`` cannot run on the device (None: it can). ``arch``: CUDA's
    (major, minor) capability, or ROCm's gcnArchName."""
    name = str(dtype).removeprefix("torch.")
    if device_type != "cuda":
        return None
    if hip is None:
        if "fnuz" in name:
            return TEXTS["fnuz_on_nvidia"].format(name=name)
        if tuple(arch) < (8, 9):
            return TEXTS["old_gpu"].format(major=arch[0], minor=arch[1])
        return None
    gfx = str(arch)
    if "fnuz" in name and not gfx.startswith("gfx94"):
        return TEXTS["fnuz_not_mi300"].format(name=name, gfx=gfx)
    if "fnuz" not in name and gfx.startswith("gfx94"):
        return TEXTS["ocp_on_mi300"].format(name=name, gfx=gfx)
    return None


def _device_problem(t: torch.Tensor) -> str | None:
    if t.device.type != "cuda":
        return None
    hip = torch.version.hip
    arch = (
        torch.cuda.get_device_properties(t.device).gcnArchName
        if hip
        else torch.cuda.get_device_capability(t.device)
    )
    return device_lacks(t.dtype, "cuda", hip, arch)


def _codes(op: str, name: str, t: torch.Tensor, fmt: Format) -> None:
    """NaN (and Inf) codes in a float8 operand."""
    nan = torch.isnan(t)
    inf = torch.isinf(t) if fmt.has_inf else None
    nan_count = int(nan.sum())
    inf_count = int(inf.sum()) if inf is not None else 0
    if nan_count or inf_count:
        bad = nan if inf is None else nan | inf
        first = int(bad.reshape(-1).nonzero()[0, 0])
        raise Fp8NonFiniteError(
            op=op,
            operand=name,
            fp8_dtype=fmt.name,
            nan_codes=nan_count + inf_count,
            nan_count=nan_count,
            posinf_count=int((t.float() == float("inf")).sum()) if inf_count else 0,
            neginf_count=int((t.float() == float("-inf")).sum()) if inf_count else 0,
            numel=t.numel(),
            shape=list(t.shape),
            dtype=str(t.dtype),
            first_bad_index=first,
            first_bad_value=str(float(t.reshape(-1)[first].float())),
        )


def _scale(op: str, name: str, s: torch.Tensor) -> None:
    v = s.detach().float().reshape(-1)
    bad = ~(torch.isfinite(v) & (v > 0) & torch.isfinite(v.reciprocal()))
    count = int(bad.sum())
    if count:
        first = int(bad.nonzero()[0, 0])
        raise Fp8ScaleError(
            op=op,
            operand=name,
            scale_name=name,
            scale_shape=list(s.shape),
            bad_count=count,
            count=v.numel(),
            first_bad_index=first,
            first_bad_value=str(float(v[first])),
        )


def _operands(op: str, a: torch.Tensor, b: torch.Tensor) -> tuple[Format, Format]:
    fmts = []
    for name, t in (("mat_a", a), ("mat_b", b)):
        fmt = FORMATS.get(t.dtype)
        if fmt is None:
            raise Fp8ArgumentError(
                op=op,
                problem=TEXTS["not_float8"].format(name=name, dtype=t.dtype),
                next=TEXTS["not_float8_next"].format(name=name),
            )
        lacks = _device_problem(t)
        if lacks:
            raise Fp8ArgumentError(
                op=op,
                problem=TEXTS["device_lacks"].format(name=name, why=lacks),
                device=str(t.device),
                next=TEXTS["device_lacks_next"],
            )
        fmts.append(fmt)
    return fmts[0], fmts[1]


def _layout(op: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """cuBLASLt's FP8 GEMM is TN only: mat_a row-major, mat_b column-major (the same rule on
    every device: code that passes on the CPU must not fail on the GPU)."""
    for name, t, want, ok in (
        ("mat_a", a, "row-major", a.dim() == 2 and a.stride(-1) == 1),
        ("mat_b", b, "column-major", b.dim() == 2 and b.stride(-2) == 1),
    ):
        if not ok:
            raise Fp8ArgumentError(
                op=op,
                problem=TEXTS["layout"].format(
                    name=name, shape=list(t.shape), strides=tuple(t.stride()), want=want
                ),
                next=TEXTS[f"layout_next_{name}"],
            )


def _scale_shapes(op: str, a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> None:
    """float32 scales: tensorwise (one value each) or rowwise (scale_a [M, 1], scale_b [1, N])."""
    if sa.dtype != torch.float32 or sb.dtype != torch.float32:
        return  # blockwise (e8m0 / e4m3 block scales): torch checks them
    m, n = a.shape[0], b.shape[1]
    tensorwise = sa.numel() == 1 and sb.numel() == 1
    rowwise = tuple(sa.shape) == (m, 1) and tuple(sb.shape) == (1, n)
    if not (tensorwise or rowwise):
        raise Fp8ArgumentError(
            op=op,
            problem=TEXTS["scale_shapes"].format(
                sa=list(sa.shape), sb=list(sb.shape), m=m, k=a.shape[1], k2=b.shape[0], n=n
            ),
            next=TEXTS["scale_shapes_next"],
        )


def _output(op: str, out: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor) or out.dtype in FORMATS:
        return
    if bool(torch.isfinite(out).all()):
        return
    raise Fp8NonFiniteError(
        op=op,
        operand="output",
        output=True,
        numel=out.numel(),
        shape=list(out.shape),
        dtype=str(out.dtype),
        **_scan_counts(out),
    )


def _arg(args: tuple, kwargs: dict, index: int, *names: str) -> Any:
    if len(args) > index:
        return args[index]
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return None


def _scales(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [v for v in (value or []) if isinstance(v, torch.Tensor)]


def _checked(op: str, original: Any, positions: tuple[int, int, int, int], mm: bool) -> Any:
    ia, ib, isa, isb = positions

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if is_quiet() or torch.compiler.is_compiling():
            return original(*args, **kwargs)
        try:
            return checked(*args, **kwargs)
        except (Fp8NonFiniteError, Fp8ScaleError) as err:  # with the capsule: replay reruns the GEMM
            _scaled_capsule.attach(err, _scaled_capsule.capture_scaled(err, op, args, kwargs))
            raise

    def checked(*args: Any, **kwargs: Any) -> Any:
        a = _arg(args, kwargs, ia, "self", "mat_a", "input")
        b = _arg(args, kwargs, ib, "mat2", "mat_b")
        sa = _arg(args, kwargs, isa, "scale_a")
        sb = _arg(args, kwargs, isb, "scale_b")
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            fa, fb = _operands(op, a, b)
            if mm:
                _layout(op, a, b)
                if isinstance(sa, torch.Tensor) and isinstance(sb, torch.Tensor):
                    _scale_shapes(op, a, b, sa, sb)
            _codes(op, "mat_a", a, fa)
            _codes(op, "mat_b", b, fb)
        for name, value in (("scale_a", sa), ("scale_b", sb)):
            for s in _scales(value):
                _scale(op, name, s)
        out = original(*args, **kwargs)
        _output(op, out)
        return out

    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call


def check_cast(x: torch.Tensor, codes: torch.Tensor) -> None:
    """The checks of one cast of ``x`` to float8 (``codes``: what it made)."""
    fmt = FORMATS[codes.dtype]
    base = {
        "op": "cast",
        "operand": "input",
        "fp8_dtype": fmt.name,
        "numel": x.numel(),
        "shape": list(x.shape),
        "dtype": str(x.dtype),
    }
    counts = _scan_counts(x)
    if counts["nan_count"] or counts["posinf_count"] or counts["neginf_count"]:
        raise Fp8NonFiniteError(**base, **counts)
    a = x.detach().abs()
    saturated = int((a > fmt.clipped_above).sum())
    nonzero = int(torch.count_nonzero(x))
    flushed = max(nonzero - int(torch.count_nonzero(codes.view(torch.uint8) & 0x7F)), 0)
    sat_fraction, flush_fraction = saturated / max(x.numel(), 1), flushed / max(nonzero, 1)
    if sat_fraction <= THRESHOLDS.saturate and flush_fraction <= THRESHOLDS.flush:
        return
    fields = {
        **base,
        "amax": float(a.max()),
        "saturated": saturated,
        "saturated_fraction": sat_fraction,
        "flushed": flushed,
        "nonzero": nonzero,
        "flushed_fraction": flush_fraction,
        "fp8_max": fmt.max,
        "fp8_tiny": fmt.tiny,
        "saturate_limit": THRESHOLDS.saturate,
        "flush_limit": THRESHOLDS.flush,
    }
    if THRESHOLDS.strict:
        raise Fp8RangeError(**fields)
    key = (tuple(x.shape), fmt.name)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(Fp8RangeWarning(range_message(fields)), stacklevel=3)


def _checked_to(original: Any) -> Any:
    @functools.wraps(original)
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if (
            isinstance(out, torch.Tensor)
            and out.dtype in FORMATS
            and self.dtype not in FORMATS
            and self.is_floating_point()
            and not is_quiet()
            and not torch.compiler.is_compiling()
        ):
            check_cast(self, out)
        return out

    to.__wrapped__ = original  # type: ignore[attr-defined]
    return to


def _targets() -> list[tuple[Any, str, str, tuple[int, int, int, int], bool]]:
    out = [(torch, "_scaled_mm", "torch._scaled_mm", (0, 1, 2, 3), True)]
    if hasattr(F, "scaled_mm"):
        out.append((F, "scaled_mm", "F.scaled_mm", (0, 1, 2, 4), True))
    if hasattr(torch, "_scaled_grouped_mm"):
        out.append((torch, "_scaled_grouped_mm", "torch._scaled_grouped_mm", (0, 1, 2, 3), False))
    return out


def install() -> None:
    """Check every direct FP8 call of the process from now on (nested calls count)."""
    with _lock:
        _depth[0] += 1
        if _installed:
            return
        for owner, attr, op, positions, mm in _targets():
            original = getattr(owner, attr)
            _installed[(id(owner), attr)] = (owner, attr, original)
            setattr(owner, attr, _checked(op, original, positions, mm))
        _installed[(id(torch.Tensor), "to")] = (torch.Tensor, "to", torch.Tensor.to)
        torch.Tensor.to = _checked_to(torch.Tensor.to)  # type: ignore[method-assign]


def uninstall() -> None:
    with _lock:
        _depth[0] = max(_depth[0] - 1, 0)
        if _depth[0]:
            return
        for owner, attr, original in _installed.values():
            setattr(owner, attr, original)
        _installed.clear()


@contextmanager
def checked_fp8() -> Iterator[None]:
    """Inside the block, ``torch._scaled_mm``, ``F.scaled_mm``, ``torch._scaled_grouped_mm`` and
    casts to float8 are checked (module docstring); process-wide, as ``run`` does."""
    install()
    try:
        yield
    finally:
        uninstall()
