"""The pieces every error message is written from: sizes, shapes, dtypes, memory and
environment lines, the watch findings' coordinates and input lists. Pure functions of
an error's fields; no exception class lives here."""

from __future__ import annotations

from typing import Any


def _bytes(value: Any) -> str:
    if value is None:
        return "?"
    value = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


def _memory_line(f: dict[str, Any]) -> str | None:
    if f.get("free_bytes") is None and f.get("torch_allocated_bytes") is None:
        return None
    parts = []
    if f.get("free_bytes") is not None:
        parts.append(f"{_bytes(f['free_bytes'])} free of {_bytes(f.get('total_bytes'))} on the device")
    if f.get("torch_allocated_bytes") is not None:
        parts.append(
            f"torch: {_bytes(f['torch_allocated_bytes'])} allocated, "
            f"{_bytes(f.get('torch_reserved_bytes'))} reserved"
        )
    if f.get("workspace_bytes") is not None:
        parts.append(f"cuBLAS workspace {_bytes(f['workspace_bytes'])}")
    return "memory: " + "; ".join(parts)


def _environment_line(env: dict[str, Any]) -> str:
    parts = [f"torch {env.get('torch')} (CUDA {env.get('torch_cuda') or 'none'})"]
    if env.get("driver"):
        parts.append(f"driver {env['driver']} / runtime {env.get('runtime')}")
    if env.get("cublas"):
        libs = env.get("cublas_libraries") or []
        parts.append(f"cuBLAS {env['cublas']}" + (f" ({', '.join(libs)})" if libs else ""))
    if env.get("gpu"):
        parts.append(f"GPU {env['gpu']} ({env.get('arch_check')})")
    parts.append("TF32 on" if env.get("allow_tf32") else "TF32 off")
    for name, value in (env.get("env") or {}).items():
        parts.append(f"{name}={value}")
    return "; ".join(parts)


def _distributed_rank() -> dict[str, int]:
    """This process's rank when it is one of several (torch.distributed or torchrun's env)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    except Exception:  # the error path must not fail
        pass
    import os

    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is not None and world is not None and rank.isdigit() and world.isdigit() and int(world) > 1:
        return {"rank": int(rank), "world_size": int(world)}
    return {}


def _watch_lines(f: dict[str, Any]) -> list[str]:
    """The op's inputs and the original message, for errors watch() re-raised."""
    lines = []
    inputs = _inputs_line(f)
    if inputs:
        lines.append(inputs)
    if f.get("original_error"):
        lines.append(f"original error: {f['original_error']}")
    return lines


def _expert_line(f: dict[str, Any]) -> str | None:
    """Where in an experts module an error was raised (the fields the native report place
    adds: experts_module, parameter, expert, expert_rows), or None outside one."""
    module, expert = f.get("experts_module"), f.get("expert")
    if not module or expert is None:
        return None
    rows = f.get("expert_rows")
    text = f"in expert {expert} of '{module}'"
    if f.get("parameter"):
        text += f", parameter {f['parameter']} ({f['parameter']}[{expert}])"
    if isinstance(rows, list) and len(rows) == 2:
        begin, end = rows
        text += (
            f"; the expert's rows of the sorted input are {begin}..{end - 1} ({end - begin} rows)"
            if end > begin
            else "; no row was routed to it"
        )
    return text


def _layer(name: Any) -> str:
    return f"'{name}'" if name else "(unnamed layer)"


# c10's names (what the native side reports) -> how torch users write them.
_DTYPES = {
    "Float": "torch.float32",
    "Double": "torch.float64",
    "Half": "torch.float16",
    "BFloat16": "torch.bfloat16",
    "Long": "torch.int64",
    "Int": "torch.int32",
    "Short": "torch.int16",
    "Char": "torch.int8",
    "Byte": "torch.uint8",
    "Bool": "torch.bool",
    "ComplexFloat": "torch.complex64",
    "ComplexDouble": "torch.complex128",
    "Float8_e4m3fn": "torch.float8_e4m3fn",
    "Float8_e5m2": "torch.float8_e5m2",
}


def _dtype(value: Any) -> str:
    return _DTYPES.get(str(value), str(value))


def _shape(value: Any) -> str:
    if value is None:
        return "?"
    return "[" + ", ".join(str(v) for v in value) + "]"


# What runs a guarded GEMM, per device and dtype (the native backends' names).
_ROUTINES = {
    "cuda": "cublasSgemm (float32; TF32 as torch.backends.cuda.matmul.allow_tf32 says), "
    "cublasGemmEx with CUBLAS_COMPUTE_32F (bfloat16, float16), cublasDgemm (float64)",
    "cpu": "torch's CPU addmm (float32, bfloat16, float16, float64)",
}


def _routines_on(device: Any) -> str:
    return _ROUTINES["cuda" if str(device).startswith("cuda") else "cpu"]


def _value_name(value: Any) -> str:
    if isinstance(value, str):
        return {"nan": "NaN", "inf": "+Inf", "-inf": "-Inf"}.get(value, value)
    return str(value)


def _fold_inputs(fields: dict[str, Any]) -> None:
    """The native report's input0_shape, input1_dtype, ... -> input_shapes, input_dtypes, ..."""
    count = fields.pop("num_inputs", None)
    if count is None:
        return
    for part in ("name", "shape", "strides", "dtype", "device"):
        values = [fields.pop(f"input{i}_{part}", None) for i in range(int(count))]
        key = "input_names" if part == "name" else f"input_{part}" if part == "strides" else f"input_{part}s"
        fields[key] = [_dtype(v) for v in values] if part == "dtype" else values
    # The absolute maximum of each input's finite values, where the scan read it.
    absmax = [fields.pop(f"input{i}_absmax", None) for i in range(int(count))]
    fields["input_absmax"] = absmax if any(v is not None for v in absmax) else None


def _coords(index: Any, shape: Any) -> list[int] | None:
    if index is None or shape is None or int(index) < 0:
        return None
    coords, rest = [], int(index)
    for size in reversed(list(shape)):
        coords.append(rest % size if size else 0)
        rest = rest // size if size else 0
    return coords[::-1]


def _where(f: dict[str, Any]) -> str:
    """Where watch saw the op: a module of the watched model, or which side of it."""
    if f.get("module") is None:
        return str(f.get("outside") or "outside the watched model's modules")
    return f"in module '{f['module']}'" if f["module"] else "in the watched model's top level"


def _inputs_line(f: dict[str, Any]) -> str | None:
    shapes = f.get("input_shapes")
    if not shapes:
        return None
    parts = []
    for name, shape, dtype, strides in zip(
        f.get("input_names") or [], shapes, f.get("input_dtypes") or [], f.get("input_strides") or []
    ):
        parts.append(f"{name} {_shape(shape)} {dtype} strides {_shape(strides)}")
    return "inputs: " + "; ".join(parts)


# What usually makes an op produce non-finite values from finite inputs.
_PRODUCER_HINTS = {
    "log": "a log of a negative number (NaN) or of zero (-Inf): clamp the argument, e.g. x.clamp_min(eps)",
    "sqrt": "a sqrt of a negative number, or its gradient at 0 (Inf): clamp the argument, add eps",
    "rsqrt": "an rsqrt of zero or of a negative number: add eps to the argument",
    "pow": "a negative base with a fractional exponent, or an overflow",
    "div": "a division by zero: add eps to the denominator or mask it",
    "reciprocal": "a reciprocal of zero: add eps",
    "exp": "an overflow (exp of more than ~88 in float32): subtract the max first, use logsumexp",
    "acos": "an argument outside [-1, 1] (or the gradient at +-1)",
    "asin": "an argument outside [-1, 1] (or the gradient at +-1)",
}


def _counts_text(f: dict[str, Any]) -> str:
    return f"{f.get('nan_count')} NaN, {f.get('posinf_count')} +Inf, {f.get('neginf_count')} -Inf"


def _first_bad_line(f: dict[str, Any], name: str) -> str:
    """'first bad element: flat index i = name[c0, c1]' (watch errors)."""
    line = f"first bad element: flat index {f.get('first_bad_index')}"
    if f.get("first_bad_coords") is not None:
        line += f" = {name}[{', '.join(str(c) for c in f['first_bad_coords'])}]"
    return line
