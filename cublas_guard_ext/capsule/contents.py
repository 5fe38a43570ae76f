"""The failure capsule: the failing cuBLAS-side call, written to one file.

When a guarded call fails on the cuBLAS side (a :class:`CublasError`, a
:class:`PendingCudaError`, a :class:`CudaLaunchError`, from SafeLinear's
forward, either gradient GEMM, ``cg.linear`` or watch's re-raise), the error
constructor calls :func:`capture`: it writes the call (routine, sizes, leading
dimensions, dtypes, math mode, alpha, beta, workspace), the buffers cuBLAS read
(their values when all of them fit ``CUBLAS_GUARD_CAPSULE_MAX_BYTES``, else
their NaN/Inf counts, min/max and a SHA-256), the layer, phase and call number,
the Python stack and the environment (torch, the CUDA runtime and driver, the
libcublas and libcublasLt actually loaded, the GPU, the arch lists, the
relevant variables). The file holds only plain containers, numbers, strings and
tensors, so ``torch.load(path, weights_only=True)`` reads it without running any
code. ``python -m cublas_guard_ext replay PATH`` runs the call alone.

Settings (environment): ``CUBLAS_GUARD_CAPSULE=0`` turns capture off;
``CUBLAS_GUARD_CAPSULE_DIR`` is the folder (default: the user's cache folder,
``$XDG_CACHE_HOME/cublas_guard_ext/capsules`` or ``~/.cache/...``);
``CUBLAS_GUARD_CAPSULE_KEEP`` the number of newest capsules kept (default 20).

Capture never hides or changes the original error: anything that goes wrong
here is caught, the error's ``capsule`` is None and its message says why in one
line.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import os
import re
import threading
import traceback
from pathlib import Path
from typing import Any

import torch

from ..errors import parse as _errors_parse
from . import safe_read as _capsule_file
from .environment_block import environment, loaded_cublas  # noqa: F401  (public here: the doctor reads them)
from .safe_read import NOT_A_CAPSULE, REFUSED_CODE, CapsuleFileError  # noqa: F401  (public here)

_counter = itertools.count(1)

FORMAT = "cublas_guard_ext capsule"
VERSION = 1
ENV_OFF = "CUBLAS_GUARD_CAPSULE"
ENV_DIR = "CUBLAS_GUARD_CAPSULE_DIR"
ENV_MAX_BYTES = "CUBLAS_GUARD_CAPSULE_MAX_BYTES"
ENV_KEEP = "CUBLAS_GUARD_CAPSULE_KEEP"
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_KEEP = 20
SUFFIX = ".cgcapsule.pt"


def enabled() -> bool:
    return os.environ.get(ENV_OFF, "1").strip() != "0"


def directory() -> Path:
    chosen = os.environ.get(ENV_DIR)
    if chosen:
        return Path(chosen).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "cublas_guard_ext" / "capsules"


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def max_bytes() -> int:
    return _int_env(ENV_MAX_BYTES, DEFAULT_MAX_BYTES)


# ---------------------------------------------------------------------------
# Tensors: what is kept of each
# ---------------------------------------------------------------------------
def _alignment(t: torch.Tensor) -> int:
    address, alignment = t.data_ptr(), 1
    while alignment < 256 and address % (alignment * 2) == 0:
        alignment *= 2
    return alignment


def _describe(t: torch.Tensor) -> dict[str, Any]:
    return {
        "shape": list(t.shape),
        "strides": list(t.stride()),
        "storage_offset": int(t.storage_offset()),
        "dtype": str(t.dtype),
        "device": str(t.device),
        "alignment": _alignment(t),
        "numel": int(t.numel()),
        "bytes": int(t.numel() * t.element_size()),
    }


def _statistics(t: torch.Tensor) -> dict[str, Any]:
    """NaN/Inf counts, finite min/max and a SHA-256 of the raw bytes (read in 64 MiB pieces)."""
    flat = t.detach().reshape(-1)
    finite = torch.isfinite(flat)
    stats: dict[str, Any] = {
        "nan_count": int(torch.isnan(flat).sum()),
        "posinf_count": int((flat == float("inf")).sum()),
        "neginf_count": int((flat == float("-inf")).sum()),
        "min": None,
        "max": None,
    }
    if bool(finite.any()):
        values = flat[finite]
        stats["min"], stats["max"] = float(values.min()), float(values.max())
    digest = hashlib.sha256()
    step = max(1, (64 << 20) // max(1, flat.element_size()))
    for start in range(0, flat.numel(), step):
        digest.update(bytes(flat[start : start + step].cpu().clone().untyped_storage()))
    stats["sha256"] = digest.hexdigest()
    return stats


UNREAD_C = "not read: beta = 0, so cuBLAS does not read C; stored as zeros (its memory was uninitialised)"


def _keep(
    tensors: dict[str, torch.Tensor], store_values: bool, unread: frozenset[str] = frozenset()
) -> tuple[dict[str, Any], str]:
    """Each tensor's description, with its values or its statistics; and which of the two.

    ``unread``: buffers the call does not read (C with beta = 0: the output's fresh, never
    initialised memory, often NaN, which would make ``alpha op(A) op(B) + beta C`` NaN).
    Described as the call got them, kept as zeros, marked ``read: False``.
    """
    out: dict[str, Any] = {}
    kept = "values" if store_values else "statistics"
    for name, t in tensors.items():
        entry = _describe(t)
        if name in unread:
            zeros = torch.zeros(t.numel(), dtype=t.dtype)
            entry["read"], entry["note"] = False, UNREAD_C
            entry["values" if store_values else "statistics"] = zeros if store_values else _statistics(zeros)
            out[name] = entry
            continue
        try:
            with torch.no_grad():
                if store_values:
                    entry["values"] = t.detach().cpu().clone()
                else:
                    entry["statistics"] = _statistics(t)
        except Exception as err:  # a broken CUDA context: nothing on the device is readable
            entry["unreadable"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            kept = "unreadable"
        out[name] = entry
    return out, kept


# ---------------------------------------------------------------------------
# The call
# ---------------------------------------------------------------------------
def _routine(device: str, dtype: torch.dtype) -> str:
    if not device.startswith("cuda"):
        return "torch CPU addmm"
    return {torch.float32: "cublasSgemm", torch.float64: "cublasDgemm"}.get(dtype, "cublasGemmEx")


def _math_mode(device: str, dtype: torch.dtype) -> str:
    if not device.startswith("cuda"):
        return f"cpu (torch addmm, {str(dtype).removeprefix('torch.')})"
    if dtype == torch.float32:
        return (
            "CUBLAS_TF32_TENSOR_OP_MATH" if torch.backends.cuda.matmul.allow_tf32 else "CUBLAS_DEFAULT_MATH"
        )
    if dtype in (torch.float16, torch.bfloat16):
        return "CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION"
    return "CUBLAS_DEFAULT_MATH"


# A cuBLAS GEMM's arguments as the native error report names them (csrc's gemm report): the
# capsule's recorded call and run's incident report both read these fields.
GEMM_ARGUMENT_FIELDS = (
    "transa",
    "transb",
    "m",
    "n",
    "k",
    "lda",
    "ldb",
    "ldc",
    "alpha",
    "beta",
    "data_type",
    "compute_type",
    "math_mode",
)


def _recorded_call(f: dict[str, Any]) -> dict[str, Any]:
    """The GEMM as the native report describes it (a CublasError from a guarded GEMM)."""
    call = {key: f.get(key) for key in (*GEMM_ARGUMENT_FIELDS, "chunk", "workspace_bytes")}
    call["routine"] = f.get("api")
    call["dtype"] = f.get("c_dtype") or f.get("a_dtype")
    call["device"] = str(f.get("c_device") or f.get("a_device") or "")
    call["source"] = "recorded"
    return call


def _planned_call(phase: str, ops: dict[str, torch.Tensor]) -> tuple[dict[str, Any], Any] | None:
    """The GEMM a guarded call was about to run, from its operands' shapes, laid out contiguously.

    For errors raised before or around the GEMM (an earlier kernel's CUDA error, a guard
    kernel's launch). Returns (call, make_buffers); the call is computed from shapes alone
    (in a broken CUDA context nothing on the device can be read), make_buffers() builds the
    "a", "b", "c" buffers from the operands and may fail.
    """
    try:
        if phase == "forward":
            x, w, bias = ops["input"], ops["weight"], ops.get("bias")
            out_f, in_f = w.shape
            rows = x.numel() // max(1, in_f)
            call = _gemm_args(
                "T", "N", out_f, rows, in_f, in_f, in_f, out_f, 1.0 if bias is not None else 0.0
            )

            def make() -> dict[str, torch.Tensor]:
                c = torch.zeros(rows, out_f, dtype=w.dtype, device=w.device)
                if bias is not None:
                    c.copy_(bias.detach().expand_as(c))
                return {"a": _flat_copy(w), "b": _flat_copy(x), "c": c.reshape(-1)}
        elif phase == "grad_input":
            g, w = ops["grad_output"], ops["weight"]
            out_f, in_f = w.shape
            rows = g.numel() // max(1, out_f)
            call = _gemm_args("N", "N", in_f, rows, out_f, in_f, out_f, in_f)

            def make() -> dict[str, torch.Tensor]:
                c = torch.zeros(rows * in_f, dtype=w.dtype, device=w.device)
                return {"a": _flat_copy(w), "b": _flat_copy(g), "c": c}
        elif phase == "grad_weight":
            g, x = ops["grad_output"], ops["input"]
            out_f, in_f = g.shape[-1], x.shape[-1]
            rows = x.numel() // max(1, in_f)
            call = _gemm_args("N", "T", in_f, out_f, rows, in_f, out_f, in_f)

            def make() -> dict[str, torch.Tensor]:
                c = torch.zeros(out_f * in_f, dtype=x.dtype, device=x.device)
                return {"a": _flat_copy(x), "b": _flat_copy(g), "c": c}
        else:
            return None
        device, dtype = (
            str(ops["weight" if "weight" in ops else "input"].device),
            ops["weight" if "weight" in ops else "input"].dtype,
        )
    except Exception:  # operands that do not make a linear
        return None
    call = {key: int(v) if isinstance(v, int) else v for key, v in call.items()}
    call.update(
        routine=_routine(device, dtype),
        dtype=str(dtype),
        device=device,
        math_mode=_math_mode(device, dtype),
        data_type=None,
        compute_type=None,
        chunk=None,
        workspace_bytes=None,
        source="planned",
    )
    return call, make


def _gemm_args(
    transa: str, transb: str, m: int, n: int, k: int, lda: int, ldb: int, ldc: int, beta: float = 0.0
) -> dict[str, Any]:
    """One GEMM's cuBLAS arguments (column-major, alpha 1), as a capsule records them."""
    return dict(transa=transa, transb=transb, m=m, n=n, k=k, lda=lda, ldb=ldb, ldc=ldc, alpha=1.0, beta=beta)


def _flat_copy(t: torch.Tensor) -> torch.Tensor:
    """An operand's own flat copy: the replay's buffer, never a view of the caller's tensor."""
    return t.detach().reshape(-1).clone()


def _spans(call: dict[str, Any]) -> dict[str, int]:
    """Elements each operand of a column-major call spans: (outer - 1) * ld + inner."""

    def span(inner: int, outer: int, ld: int) -> int:
        return 0 if inner <= 0 or outer <= 0 else (outer - 1) * ld + inner

    m, n, k = call["m"], call["n"], call["k"]
    a = span(k, m, call["lda"]) if call["transa"] == "T" else span(m, k, call["lda"])
    b = span(n, k, call["ldb"]) if call["transb"] == "T" else span(k, n, call["ldb"])
    return {"a": a, "b": b, "c": span(m, n, call["ldc"])}


def _plain(value: Any) -> Any:
    """A value torch.load(weights_only=True) reads back: containers, numbers, strings."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (torch.__version__ is a TorchVersion) are globals weights_only refuses.
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return "".join(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def build(err: BaseException, native: dict[str, Any] | None) -> dict[str, Any]:
    """The capsule of ``err`` as a dict (written by :func:`capture`)."""
    fields = dict(getattr(err, "fields", {}))
    native = native or {}
    buffers = {k: v for k, v in (native.get("buffers") or {}).items() if isinstance(v, torch.Tensor)}
    operands = {k: v for k, v in (native.get("operands") or {}).items() if isinstance(v, torch.Tensor)}
    phase = native.get("phase") or fields.get("purpose") or fields.get("phase")
    call: dict[str, Any] | None = None
    unreadable = None
    if "m" in fields and buffers:
        call = _recorded_call(fields)
    elif operands and phase:
        planned = _planned_call(str(phase), operands)
        if planned is not None:
            call, make = planned
            try:
                with torch.no_grad():
                    buffers = make()
            except Exception as problem:  # a broken CUDA context: only the shapes are known
                buffers = {}
                unreadable = f"{type(problem).__name__}: {(str(problem).splitlines() or [''])[0]}"
    limit = max_bytes()
    total = sum(t.numel() * t.element_size() for t in buffers.values())
    total_operands = sum(t.numel() * t.element_size() for t in operands.values())
    # A recorded call's C with beta = 0 is unread, uninitialised memory (a planned one's is zeros).
    recorded_beta = call.get("beta") if call is not None and call.get("source") == "recorded" else None
    unread = frozenset({"c"}) if recorded_beta is not None and recorded_beta == 0 else frozenset()
    gemm, kept = _keep(buffers, total <= limit, unread)
    if call is not None and not buffers:
        spans = _spans(call)
        gemm = {
            name: {
                "numel": spans[name],
                "dtype": call["dtype"],
                "device": call["device"],
                "alignment": 256,
                "unreadable": unreadable or "not available",
            }
            for name in spans
        }
        kept = "unreadable"
    if operands and buffers:
        described = {name: _describe(t) for name, t in operands.items()}
    else:
        described, _ = _keep(operands, False)
    here = os.path.dirname(os.path.abspath(__file__))
    frames = traceback.extract_stack()
    while frames and os.path.abspath(frames[-1].filename).startswith(here):
        frames.pop()  # this package's frames: the error constructor and the capsule itself
    stack = traceback.format_list(frames)
    return {
        "format": FORMAT,
        "version": VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "pid": os.getpid(),
        "kind": getattr(err, "kind", type(err).__name__),
        "error_class": type(err).__name__,
        "message": str(err),
        "fields": _plain({k: v for k, v in fields.items() if k != "environment"}),
        "status": fields.get("status"),
        "status_name": getattr(err, "status_name", None) if fields.get("status") is not None else None,
        "layer": fields.get("layer"),
        "phase": phase,
        "call_number": native.get("call_number"),
        "call": _plain(call),
        "gemm_operands": gemm,
        "values": kept if call is not None else "none (no GEMM call)",
        "values_unreadable": unreadable,
        "values_limit_bytes": limit,
        "values_total_bytes": int(total),
        "call_operands": described,
        "call_operands_total_bytes": int(total_operands),
        "python_stack": [line.rstrip("\n") for line in stack],
        "thread": threading.current_thread().name,
        "environment": _plain(environment()),
    }


def _prune(folder: Path, keep: int) -> None:
    capsules = sorted(folder.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)
    for old in capsules[:-keep] if keep > 0 else capsules:
        try:
            old.unlink()
        except OSError:
            pass


def capture(err: BaseException, native: dict[str, Any] | None = None) -> tuple[str | None, str | None]:
    """Writes the capsule of ``err``: (path, None), or (None, why not) in one line.

    Never raises: capture must not hide the error being raised.
    """
    if not enabled():
        return None, None
    try:
        folder = directory()
        folder.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        kind = re.sub(r"[^a-z_]", "", str(getattr(err, "kind", "error")))
        path = folder / f"{stamp}-{os.getpid()}-{next(_counter)}-{kind}{SUFFIX}"
        data = build(err, native)
        partial = path.with_name(path.name + ".partial")
        torch.save(data, partial)
        os.replace(partial, path)
        _prune(folder, _int_env(ENV_KEEP, DEFAULT_KEEP))
        return str(path), None
    except Exception as problem:  # anything at all: the original error stands
        text = str(problem).splitlines()[0] if str(problem) else ""
        return None, f"{type(problem).__name__}: {text}"


def load(path: str | os.PathLike) -> dict[str, Any]:
    """A capsule's contents, read with ``weights_only=True`` (no code runs).

    Raises :class:`CapsuleFileError` for a missing file, a file that is not a capsule, and
    a pickle that names a callable to run when loaded (which is never run): its message is
    one line, never torch's advice to load with ``weights_only=False``."""
    name = os.fspath(path)
    data = _capsule_file.read(name)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CapsuleFileError(name, NOT_A_CAPSULE)
    return data


# errors.attach_capsule (a cuBLAS-side error raised by a guarded call or watch) writes its
# capsule through capture, handed in here because errors imports nothing of the package.
_errors_parse.write_capsules_with(capture)
