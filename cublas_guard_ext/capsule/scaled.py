"""The capsule of a failing scaled (FP8) GEMM: ``torch._scaled_mm``, ``F.scaled_mm`` or
``torch._scaled_grouped_mm`` as fp8/direct.py refused or caught it, written to one file with its
float8 operands, its scales and every other argument, so that ``python -m cublas_guard_ext replay``
reruns that GEMM alone, unguarded, and says what it gives (NaN, Inf, or finite values).

And the capsule of a guarded ``Float8Linear``'s operand refused at its cast (``CAST_KEY``): the
high-precision operand, the amax and scale torchao computed, the float8 dtype and where (layer,
GEMM, operand, recipe); ``replay`` reruns torchao's cast alone (its ``tensor_to_amax``,
``amax_to_scale`` and saturated cast, per tensor or per row as the recorded amax's shape says)
and gives its amax, scale and NaN codes: what the GEMM would have been fed.

The arguments are stored encoded (:func:`encode`): tensors by name (their bytes as uint8 and their
dtype: ``torch.load(weights_only=True)`` reads it back), dtypes and torch's scaling enums by name.
Values over ``CUBLAS_GUARD_CAPSULE_MAX_BYTES`` keep only their descriptions (the replay then says
it cannot run). Capture never raises: the error being raised stands.
"""

from __future__ import annotations

import datetime
import os
import re
import traceback
from typing import Any

import torch

from . import contents

KEY = "scaled_gemm"
CAST_KEY = "float8_cast"


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).clone() if flat.numel() else torch.empty(0, dtype=torch.uint8)


def encode(args: tuple, kwargs: dict) -> tuple[list, dict, dict[str, dict[str, Any]]]:
    """(encoded args, encoded kwargs, the tensors by name: description, bytes)."""
    tensors: dict[str, dict[str, Any]] = {}

    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = {
                "shape": list(value.shape),
                "dtype": str(value.dtype),
                "device": str(value.device),
            }
            tensors[name]["tensor"] = value
            return {"tensor": name}
        if isinstance(value, torch.dtype):
            return {"dtype": str(value)}
        if isinstance(value, (list, tuple)):
            return [one(v) for v in value]
        kind = type(value)
        if kind.__module__ in ("torch.nn.functional", "torch._C") and hasattr(value, "name"):
            return {"enum": f"{kind.__name__}.{value.name}"}
        return contents._plain(value)

    return [one(a) for a in args], {k: one(v) for k, v in kwargs.items()}, tensors


def decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The argument ``encode`` wrote, rebuilt (tensors from ``tensors``)."""
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if isinstance(value, dict) and len(value) == 1:
        ((key, inner),) = value.items()
        if key == "tensor":
            return tensors[inner]
        if key == "dtype":
            return getattr(torch, inner.removeprefix("torch."))
        if key == "enum":
            kind, _, member = inner.partition(".")
            enum = getattr(torch.nn.functional, kind, None) or getattr(torch.nn.functional, kind.lstrip("_"))
            return enum.__members__[member]
    return value


def tensors_of(record: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """The stored tensors, back in their dtypes and shapes, on ``device``."""
    out = {}
    for name, entry in record["tensors"].items():
        dtype = getattr(torch, entry["dtype"].removeprefix("torch."))
        raw = entry["bytes"]
        out[name] = raw.view(dtype).reshape(entry["shape"]).to(device)
    return out


def capture_scaled(err: BaseException, op: str, args: tuple, kwargs: dict) -> tuple[str | None, str | None]:
    """Write the capsule of the scaled GEMM ``op(*args, **kwargs)`` that raised ``err``: (path, None),
    (None, why not), or (None, None) when capture is off."""
    if not contents.enabled():
        return None, None
    try:
        enc_args, enc_kwargs, tensors = encode(args, kwargs)
        record = {"op": op, "args": enc_args, "kwargs": enc_kwargs, "tensors": tensors}
        return _write(err, KEY, record, layer=None, phase=op)
    except Exception as problem:  # anything at all: the original error stands
        return None, _why(problem)


def capture_cast(
    err: BaseException, x: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor, where: dict[str, Any]
) -> tuple[str | None, str | None]:
    """Write the capsule of a guarded Float8Linear operand ``x`` refused at its float8 cast."""
    if not contents.enabled():
        return None, None
    try:
        _, _, tensors = encode((x, amax, scale), {})
        record = {"where": contents._plain(where), "tensors": tensors, "fp8_dtype": where.get("fp8_dtype")}
        phase = f"the cast of {where.get('operand')} for the {where.get('gemm')} GEMM"
        return _write(err, CAST_KEY, record, layer=where.get("layer"), phase=phase)
    except Exception as problem:  # anything at all: the original error stands
        return None, _why(problem)


def attach(err: BaseException, captured: tuple[str | None, str | None]) -> None:
    """Put a capture's (path, why not) on the FP8 error being raised, its message rewritten."""
    path, note = captured
    if path is not None or note is not None:
        err.capsule, err.capsule_note = path, note  # type: ignore[attr-defined]
        err.args = (err._format(),)  # type: ignore[attr-defined]


def _why(problem: Exception) -> str:
    text = str(problem).splitlines()[0] if str(problem) else ""
    return f"{type(problem).__name__}: {text}"


def _write(err: BaseException, key: str, record: dict[str, Any], layer: Any, phase: str) -> tuple[str, None]:
    tensors = record["tensors"]
    total = sum(t["tensor"].numel() * t["tensor"].element_size() for t in tensors.values())
    kept = total <= contents.max_bytes()
    for entry in tensors.values():
        t = entry.pop("tensor")
        entry["bytes"] = _tensor_bytes(t) if kept else None
        entry["strides"] = list(t.stride())
    record["values_kept"] = kept
    folder = contents.directory()
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    kind = re.sub(r"[^a-z_0-9]", "", str(getattr(err, "kind", "error")))
    path = folder / f"{stamp}-{os.getpid()}-{next(contents._counter)}-{kind}{contents.SUFFIX}"
    data = {
        "format": contents.FORMAT,
        "version": contents.VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "pid": os.getpid(),
        "kind": getattr(err, "kind", type(err).__name__),
        "error_class": type(err).__name__,
        "message": str(err),
        "fields": contents._plain(dict(getattr(err, "fields", {}))),
        "layer": layer,
        "phase": phase,
        "call": None,
        "values": "values" if kept else f"not kept ({total} bytes over {contents.max_bytes()})",
        key: record,
        "python_stack": [line.rstrip("\n") for line in traceback.format_list(traceback.extract_stack()[:-3])],
        "environment": contents._plain(contents.environment()),
    }
    partial = path.with_name(path.name + ".partial")
    torch.save(data, partial)
    os.replace(partial, path)
    contents._prune(folder, contents._int_env(contents.ENV_KEEP, contents.DEFAULT_KEEP))
    return str(path), None


def run_cast(data: dict[str, Any]) -> dict[str, Any]:
    """Rerun the recorded operand's float8 cast alone with torchao's own steps: {"status", "detail"}
    (failed: the amax or a scale is not finite and positive, or codes are NaN)."""
    record = data[CAST_KEY]
    if not record.get("values_kept"):
        return {"status": "not run", "detail": f"the operand is not in this capsule ({data.get('values')})"}
    try:
        from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated
    except ImportError:
        return {"status": "not run", "detail": "torchao is not installed here: the cast is torchao's"}
    x, recorded_amax, _ = (tensors_of(record, torch.device("cpu"))[f"t{i}"] for i in range(3))
    name = str(record["fp8_dtype"]).removeprefix("torch.")  # "e4m3fn", the errors' spelling
    dtype = getattr(torch, name if name.startswith("float8_") else "float8_" + name)
    with torch.no_grad():
        if recorded_amax.numel() == 1:  # tensorwise
            amax = x.abs().max().to(torch.float64)
        else:  # per row or column: the dim the recorded amax kept as 1
            dim = next(d for d in range(x.dim()) if recorded_amax.shape[d] == 1 and x.shape[d] != 1)
            amax = x.abs().amax(dim=dim, keepdim=True).to(torch.float64)
        scale = amax_to_scale(amax, dtype)
        codes = to_fp8_saturated(x.to(torch.float32) * scale, dtype).float()
    nan_codes, bad_scales = int(codes.isnan().sum()), int((~(torch.isfinite(scale) & (scale > 0))).sum())
    detail = (
        f"torchao's cast of the {record['where'].get('operand')} alone: amax {float(amax.max()):.4g}, "
        f"{bad_scales} of {scale.numel()} scales not finite and positive (smallest "
        f"{float(scale.min()):.4g}), {nan_codes} of {codes.numel()} float8 codes NaN and "
        f"{int((codes == 0).sum())} zero (a NaN code makes every output of its GEMM row NaN)"
    )
    failed = nan_codes or bad_scales or not bool(torch.isfinite(amax).all())
    return {"status": "failed" if failed else "passed", "detail": detail}


def run_recorded(data: dict[str, Any]) -> dict[str, Any]:
    """Rerun the capsule's scaled GEMM alone, unguarded: {"status": failed | passed | not run, "detail"}
    (failed: it raised, or its output holds NaN/Inf). Runs in the replay's worker process."""
    if data.get(CAST_KEY):
        return run_cast(data)
    record = data[KEY]
    if not record.get("values_kept"):
        return {
            "status": "not run",
            "detail": f"the operands' values are not in this capsule ({data.get('values')})",
        }
    devices = {entry["device"] for entry in record["tensors"].values()}
    device = torch.device(next(iter(devices), "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        return {"status": "not run", "detail": f"the GEMM ran on {device}; this machine has no CUDA GPU"}
    tensors = tensors_of(record, device)
    owner = torch.nn.functional if record["op"].startswith("F.") else torch
    fn = getattr(owner, record["op"].rpartition(".")[2])
    args = decode(record["args"], tensors)
    kwargs = {k: decode(v, tensors) for k, v in record["kwargs"].items()}
    try:
        out = fn(*args, **kwargs)
    except Exception as err:
        return {
            "status": "failed",
            "detail": f"{record['op']} raised {type(err).__name__}: {(str(err).splitlines() or [''])[0]}",
        }
    values = out.float()
    nan, inf = int(torch.isnan(values).sum()), int(torch.isinf(values).sum())
    detail = f"{record['op']} alone on {device}: {nan} NaN and {inf} Inf of {values.numel()} output values"
    zeros = int((values == 0).sum())
    if nan or inf or (values.numel() and zeros == values.numel()):
        return {"status": "failed", "detail": f"{detail}, {zeros} zeros"}
    return {"status": "passed", "detail": f"{detail}, {zeros} zeros"}


def verdict(data: dict[str, Any], first: dict[str, Any] | None) -> tuple[bool, str]:
    """(reproduced, the text) for a scaled GEMM's (or a float8 cast's) capsule and its rerun."""
    op = data[KEY]["op"] if data.get(KEY) else data.get("phase")
    error = data.get("error_class")
    if first is None or first["status"] not in ("passed", "failed"):
        return (
            False,
            f"NOT RUN: {first.get('detail') if first else 'no result'}. The capsule still has the operands.",
        )
    if first["status"] == "failed":
        return True, (
            f"REPRODUCED: {first['detail']}. Unguarded, {op} gives this silently; the guard raised "
            f"{error} before it. What was wrong, and what to do, is the error's message:\n"
            + "\n".join("  " + line for line in str(data.get("message", "")).splitlines())
        )
    return False, (
        f"NOT REPRODUCED: {first['detail']}: the {error} did not come from these operands alone "
        "(a different device or library: compare the capsule's environment with this machine)"
    )
