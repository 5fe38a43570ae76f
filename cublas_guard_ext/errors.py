"""The exception classes, and the one place where their messages are written.

Native code raises a c10 error whose last line is a JSON payload (the error's
kind and fields); :func:`from_native` turns it into one of the classes below.
Each class subclasses the built-in exception users already catch, carries its
fields as attributes (and in ``.fields``), and formats one message: the most
likely cause first, then the details, then what to do next.

Input errors that ``nn.Linear`` itself would raise as ``RuntimeError`` (wrong
shape, dtype, device) are also ``RuntimeError`` subclasses, so code written
around ``nn.Linear`` keeps catching them after the swap.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

import torch

from . import capsule as _capsule
from ._native.facts import error_context

PAYLOAD_MARKER = "[cublas_guard_ext payload] "
_PAYLOAD_RE = re.compile(re.escape(PAYLOAD_MARKER) + r"(\{.*\})\s*$", re.S)

# cublasStatus_t: name, meaning, likely causes (most likely first), next steps.
CUBLAS_STATUS: dict[int, tuple[str, str, tuple[str, ...], tuple[str, ...]]] = {
    0: ("CUBLAS_STATUS_SUCCESS", "the operation completed successfully", (), ()),
    1: (
        "CUBLAS_STATUS_NOT_INITIALIZED",
        "cuBLAS could not be initialized: creating the handle failed",
        (
            "the GPU was out of memory when cuBLAS created its handle or workspace "
            "(cuBLAS allocates outside PyTorch's caching allocator)",
            "an earlier CUDA error left the context unusable",
            "the driver is older than the CUDA runtime torch was built with",
        ),
        (
            "free memory before the first matmul: a smaller batch, torch.cuda.empty_cache()",
            "rerun with CUDA_LAUNCH_BLOCKING=1 to find an earlier failing kernel",
            "run `python -m cublas_guard_ext doctor` to compare driver and runtime versions",
        ),
    ),
    3: (
        "CUBLAS_STATUS_ALLOC_FAILED",
        "an allocation inside cuBLAS failed (its workspace or internal buffers)",
        (
            "the GPU is out of memory",
            "memory fragmentation: free memory exists but not in one piece",
        ),
        (
            "lower the batch size, or call torch.cuda.empty_cache() before the failing step",
            "set a smaller cuBLAS workspace: CUBLAS_WORKSPACE_CONFIG=:4096:8",
            "check other processes on the GPU with nvidia-smi",
        ),
    ),
    7: (
        "CUBLAS_STATUS_INVALID_VALUE",
        "an argument was out of range (m, n, k < 0, a leading dimension too small, ...)",
        (
            "a size beyond cuBLAS's 32-bit int arguments",
            "a leading dimension smaller than the rows stored (a bad stride)",
        ),
        (
            "check the failed rule and the arguments below",
            "make the operands contiguous (x.contiguous()) and retry",
        ),
    ),
    8: (
        "CUBLAS_STATUS_ARCH_MISMATCH",
        "the GPU lacks a feature this cuBLAS call needs",
        (
            "the GPU is older than this cuBLAS/torch build supports",
            "the compute mode or data type needs a newer architecture",
        ),
        (
            "run `python -m cublas_guard_ext doctor`: it compares the GPU with torch's arch list",
            "install a torch build that supports this GPU (see pytorch.org/get-started)",
        ),
    ),
    11: (
        "CUBLAS_STATUS_MAPPING_ERROR",
        "cuBLAS could not access GPU memory (a texture or memory mapping failed)",
        (
            "an earlier CUDA error corrupted the context",
            "an operand pointer is invalid (freed or on another device)",
        ),
        (
            "rerun with CUDA_LAUNCH_BLOCKING=1",
            "restart the process: the context may be unusable",
        ),
    ),
    13: (
        "CUBLAS_STATUS_EXECUTION_FAILED",
        "the GEMM kernel failed to launch or to run on the GPU",
        (
            "an EARLIER asynchronous CUDA error surfacing here: an index out of range in "
            "nn.Embedding, a gather or a loss (a device-side assert) fails silently and the "
            "next cuBLAS call reports it",
            "out of GPU memory",
            "a GPU architecture the torch build does not support",
            "a hardware fault (overheating, a failing card)",
        ),
        (
            "rerun with CUDA_LAUNCH_BLOCKING=1 so the error is raised by the kernel that failed",
            "use mode='sync' (the default) so the guard names an earlier failure before the GEMM",
            "run `python -m cublas_guard_ext doctor`",
        ),
    ),
    14: (
        "CUBLAS_STATUS_INTERNAL_ERROR",
        "an operation inside cuBLAS failed (usually a CUDA call it made)",
        (
            "an earlier asynchronous CUDA error",
            "out of GPU memory",
            "a driver/runtime mismatch",
        ),
        (
            "rerun with CUDA_LAUNCH_BLOCKING=1",
            "run `python -m cublas_guard_ext doctor`",
        ),
    ),
    15: (
        "CUBLAS_STATUS_NOT_SUPPORTED",
        "this combination of parameters is not supported by cuBLAS on this GPU",
        (
            "a math mode (TF32) or data type the GPU does not offer",
        ),
        (
            "disable TF32: torch.backends.cuda.matmul.allow_tf32 = False",
            "run `python -m cublas_guard_ext doctor`",
        ),
    ),
    16: (
        "CUBLAS_STATUS_LICENSE_ERROR",
        "the requested functionality needs a license that was not found",
        ("a cuBLAS feature behind a license check",),
        ("check the NVIDIA license configuration of this machine",),
    ),
}

_NAN_STORY = (
    "NaN/Inf do not make cuBLAS fail (a GEMM never looks at values: it returns NaN with "
    "status SUCCESS); the guard refuses them so they do not spread."
)


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


def _layer(name: Any) -> str:
    return f"'{name}'" if name else "(unnamed layer)"


# c10's names (what the native side reports) -> how torch users write them.
_DTYPES = {
    "Float": "torch.float32", "Double": "torch.float64", "Half": "torch.float16",
    "BFloat16": "torch.bfloat16", "Long": "torch.int64", "Int": "torch.int32",
    "Short": "torch.int16", "Char": "torch.int8", "Byte": "torch.uint8", "Bool": "torch.bool",
    "ComplexFloat": "torch.complex64", "ComplexDouble": "torch.complex128",
    "Float8_e4m3fn": "torch.float8_e4m3fn", "Float8_e5m2": "torch.float8_e5m2",
}


def _dtype(value: Any) -> str:
    return _DTYPES.get(str(value), str(value))


def _shape(value: Any) -> str:
    if value is None:
        return "?"
    return "[" + ", ".join(str(v) for v in value) + "]"


class GuardError(Exception):
    """Base class of every cublas_guard_ext error.

    ``fields`` holds the structured data (also readable as attributes);
    ``str(err)`` is the formatted message.
    """

    kind: ClassVar[str] = "guard"
    # Errors about the CUDA/cuBLAS runtime also describe the environment.
    with_environment: ClassVar[bool] = False
    # The failure capsule's path (cublas_guard_ext.capsule), for the cuBLAS-side errors
    # raised by a guarded call or watch; None when capture is off or writing failed
    # (then capsule_note says why).
    capsule: str | None = None
    capsule_note: str | None = None

    def __init__(self, message: str | None = None, **fields: Any) -> None:
        if message is None and "rank" not in fields:
            fields.update(_distributed_rank())
        if self.with_environment and message is None and "environment" not in fields:
            fields["environment"] = error_context()
        self.fields: dict[str, Any] = fields
        super().__init__(message if message is not None else self._format())

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__.get("fields", {})
        if name in fields:
            return fields[name]
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    # Subclasses fill these three; _format puts them in order.
    def _headline(self) -> str:
        return f"cublas_guard_ext error ({self.kind})"

    def _details(self) -> list[str]:
        return [f"{k}: {v}" for k, v in self.fields.items()]

    def _next_steps(self) -> list[str]:
        return []

    def _format(self) -> str:
        rank = self.fields.get("rank")
        prefix = f"[rank {rank}/{self.fields.get('world_size', '?')}] " if rank is not None else ""
        lines = [prefix + self._headline()]
        lines += [f"  {d}" for d in self._details()]
        if self.fields.get("environment"):
            lines.append(f"  environment: {_environment_line(self.fields['environment'])}")
        if self.capsule:
            lines.append(f"  capsule: {self.capsule} (replay the call alone: python -m cublas_guard_ext "
                         f"replay {self.capsule})")
        elif self.capsule_note:
            lines.append(f"  capsule: not written ({self.capsule_note})")
        steps = self._next_steps()
        if steps:
            lines.append("Next: " + steps[0])
            lines += [f"      {s}" for s in steps[1:]]
        return "\n".join(lines)


# What runs a guarded GEMM, per device and dtype (the native backends' names).
_ROUTINES = {
    "cuda": "cublasSgemm (float32; TF32 as torch.backends.cuda.matmul.allow_tf32 says), "
    "cublasGemmEx with CUBLAS_COMPUTE_32F (bfloat16, float16), cublasDgemm (float64)",
    "cpu": "torch's CPU addmm (float32, bfloat16, float16, float64)",
}


def _routines_on(device: Any) -> str:
    return _ROUTINES["cuda" if str(device).startswith("cuda") else "cpu"]


class DTypeError(GuardError, TypeError, RuntimeError):
    """An operand's dtype is not float32/bfloat16/float16/float64, or input and
    parameters differ in dtype (``nn.Linear`` refuses both too)."""

    kind = "dtype"

    def _headline(self) -> str:
        f = self.fields
        role, dtype = f.get("role", "input"), _dtype(f.get("dtype"))
        if f.get("reason") == "mismatch":
            return (
                f"layer {_layer(f.get('layer'))}: {role} dtype is {dtype} but {f.get('other_role')} "
                f"dtype is {_dtype(f.get('other_dtype'))}: they must match (nn.Linear refuses "
                "them too)"
            )
        return (
            f"layer {_layer(f.get('layer'))}: {role} dtype is {dtype}, but the guarded linear "
            "takes float32, bfloat16, float16 or float64 (as nn.Linear does)"
        )

    def _details(self) -> list[str]:
        device = self.fields.get("tensor_device")
        return [
            f"shape {_shape(self.fields.get('tensor_shape'))} on {device}",
            f"on {'CUDA' if str(device).startswith('cuda') else 'the CPU'} the GEMM runs as "
            f"{_routines_on(device)}",
        ]

    def _next_steps(self) -> list[str]:
        f = self.fields
        role, dtype = f.get("role", "input"), _dtype(f.get("dtype"))
        if f.get("reason") == "mismatch":
            other = _dtype(f.get("other_dtype"))
            if role in ("input", "grad_output"):
                return [
                    f"cast the {role} to the layer's dtype: x = x.to({other})",
                    f"or cast the layer: layer.to({dtype})",
                    "or run the model under torch.autocast(device_type, dtype), which casts "
                    "SafeLinear's operands exactly as nn.Linear's",
                ]
            return [f"cast the layer's parameters to one dtype: layer.to({other})"]
        if role == "input":
            steps = ["convert the input: x = x.float() (or the layer's dtype)"]
            if dtype.startswith("torch.complex"):
                steps.append("complex GEMMs are not guarded: split real and imaginary parts")
            elif not dtype.startswith("torch.float"):
                steps.append("integer/bool features are usually indices: did you mean an nn.Embedding?")
            return steps
        return [f"convert the layer's parameters: layer.float() (its {role} is {dtype})"]


class ShapeMismatchError(GuardError, ValueError, RuntimeError):
    """The input's last dim is not the layer's ``in_features`` (or the input is 0-d)."""

    kind = "shape_mismatch"

    def _headline(self) -> str:
        f = self.fields
        shape = f.get("shape")
        if f.get("reason") == "operand":  # a parameter or gradient, not the input
            return (
                f"layer {_layer(f.get('layer'))}: {f.get('role')} has shape {_shape(shape)}, "
                f"expected {f.get('expected_shape')}"
            )
        expected = f.get("expected_last_dim")
        if f.get("reason") == "zero_dim":
            return f"layer {_layer(f.get('layer'))}: input is 0-d; expected [..., {expected}]"
        return (
            f"layer {_layer(f.get('layer'))}: input shape {_shape(shape)} has last dim "
            f"{shape[-1] if shape else '?'}, expected in_features = {expected}"
        )

    def _details(self) -> list[str]:
        f = self.fields
        if f.get("reason") == "operand":
            return []
        return [
            f"input shape: {_shape(f.get('shape'))}",
            f"expected:    [..., {f.get('expected_last_dim')}]",
        ]

    def _next_steps(self) -> list[str]:
        if self.fields.get("reason") == "operand":
            return [
                f"the layer's {self.fields.get('role')} was replaced with a tensor of the wrong "
                "shape; check the code that assigns it"
            ]
        return [
            "check the layer before this one (its out_features) or the flatten/reshape "
            "feeding it; print(x.shape) right before the layer"
        ]

    @property
    def expected(self) -> Any:
        f = self.fields
        return f.get("expected_last_dim", f.get("expected_shape"))


class DeviceMismatchError(GuardError, ValueError, RuntimeError):
    """An operand is on another device than the layer's weight."""

    kind = "device_mismatch"

    def _headline(self) -> str:
        return (
            f"layer {_layer(self.fields.get('layer'))}: {self.fields.get('role', 'input')} is on "
            f"{self.fields.get('input_device')} but the layer's {self.fields.get('anchor', 'weight')} "
            f"is on {self.fields.get('weight_device')}"
        )

    def _details(self) -> list[str]:
        return [f"{self.fields.get('role', 'input')} shape: {_shape(self.fields.get('shape'))}"]

    def _next_steps(self) -> list[str]:
        target = self.fields.get("weight_device")
        return [
            f"move the input: x = x.to('{target}')",
            f"or move the model: model.to('{self.fields.get('input_device')}')",
        ]


class NonFiniteInputError(GuardError, ValueError):
    """NaN/+Inf/-Inf in an input (or parameter) of a guarded layer."""

    kind = "non_finite"

    def _headline(self) -> str:
        f = self.fields
        where = f"layer {_layer(f.get('layer'))}"
        if f.get("deferred"):
            backward = "backward " if f.get("pass") == "backward" else ""
            where += f", {backward}call {f.get('call')}"
            replay = f.get("replay", 0)
            if replay:  # the call was captured in a CUDA graph; this is one of its replays
                where += f" (CUDA graph replay {replay})" if replay > 0 else " (a CUDA graph replay)"
        return (
            f"{where}: {f.get('role', 'input')} has {f.get('nan_count')} NaN, "
            f"{f.get('posinf_count')} +Inf, {f.get('neginf_count')} -Inf"
        )

    def _details(self) -> list[str]:
        f = self.fields
        coords = f.get("first_bad_coords")
        role = "x" if f.get("role", "input") == "input" else f.get("role")
        first = f"first bad element: flat index {f.get('first_bad_index')}"
        if coords is not None:
            first += f" = {role}[{', '.join(str(c) for c in coords)}]"
        if f.get("first_bad_value") is not None:
            first += f" ({_value_name(f.get('first_bad_value'))})"
        if f.get("shape") is not None:
            lines = [first, f"shape {_shape(f.get('shape'))}, {f.get('numel')} elements"]
        else:  # async records keep at most 16 dims
            lines = [first, f"{f.get('ndim')}-d tensor (shape not recorded), {f.get('numel')} elements"]
        if f.get("deferred"):
            lines.append(
                f"recorded asynchronously on {f.get('device')} at that call and reported now: "
                "outputs computed since then are not to be trusted"
            )
        lines.append(_NAN_STORY)
        return lines

    def _next_steps(self) -> list[str]:
        if self.fields.get("role") in ("weight", "bias"):
            return [
                "the parameters diverged: lower the learning rate, clip gradients "
                "(torch.nn.utils.clip_grad_norm_), or reload the last good checkpoint"
            ]
        return [
            "find where the values became non-finite: check the data pipeline and the layer "
            "before this one (torch.autograd.set_detect_anomaly(True) in training)",
            "clean the data if NaN is expected there: torch.nan_to_num(x)",
        ]


def _value_name(value: Any) -> str:
    if isinstance(value, str):
        return {"nan": "NaN", "inf": "+Inf", "-inf": "-Inf"}.get(value, value)
    return str(value)


class SizeLimitError(GuardError, ValueError):
    """A GEMM argument beyond cuBLAS's 32-bit ``int`` limit."""

    kind = "size_limit"

    def _headline(self) -> str:
        f = self.fields
        return (
            f"layer {_layer(f.get('layer'))}: {f.get('api') or 'cublasSgemm'} argument {f.get('argument')} = "
            f"{f.get('value')} exceeds cuBLAS's 32-bit limit {f.get('limit')}"
        )

    def _details(self) -> list[str]:
        f = self.fields
        return [
            f"{f.get('purpose')} GEMM: m={f.get('m')} n={f.get('n')} k={f.get('k')} "
            f"lda={f.get('lda')} ldb={f.get('ldb')} ldc={f.get('ldc')}",
            "cuBLAS's classic API takes m, n, k and the leading dimensions as 32-bit int; the "
            "batch is split and badly strided operands are copied automatically, but m (the "
            "output's width: out_features in forward, in_features in backward) cannot be "
            "split, and this cuBLAS has no 64-bit API (cuBLAS 12+)",
        ]

    def _next_steps(self) -> list[str]:
        steps = [
            "use a torch built with CUDA 12 or newer (cuBLAS 12 has the 64-bit API: "
            "cublasSgemm_64, cublasGemmEx_64, cublasDgemm_64)"
        ]
        if self.fields.get("argument") in ("lda", "ldb"):
            steps.append("a strided input's row stride is a leading dimension: x.contiguous() may fit")
        return steps


class CublasError(GuardError, RuntimeError):
    """A cuBLAS call returned a failure status."""

    kind = "cublas"
    with_environment = True

    @property
    def status(self) -> int:
        return int(self.fields.get("status", -1))

    @property
    def status_name(self) -> str:
        name = self.fields.get("status_name")
        if name:
            return str(name)
        entry = CUBLAS_STATUS.get(self.status)
        return entry[0] if entry else f"cublasStatus_t({self.status})"

    @property
    def meaning(self) -> str:
        entry = CUBLAS_STATUS.get(self.status)
        return entry[1] if entry else "an unknown cuBLAS status"

    def _headline(self) -> str:
        f = self.fields
        stage = "creating the cuBLAS handle" if f.get("stage") == "handle" else (f.get("api") or "the GEMM")
        if f.get("op"):  # re-raised by watch() from an op it observed
            return f"watch: {f.get('op')} {_where(f)} ({f.get('phase')}): {self.status_name}: {self.meaning}"
        if f.get("precheck"):
            return (
                f"layer {_layer(f.get('layer'))}: {self.status_name} (refused before the call): "
                f"the arguments break the rule {f.get('rule')}"
            )
        return f"layer {_layer(f.get('layer'))}: {self.status_name} from {stage}: {self.meaning}"

    def _details(self) -> list[str]:
        f = self.fields
        entry = CUBLAS_STATUS.get(self.status)
        lines = []
        if entry and entry[2]:
            lines.append("likely causes, most likely first:")
            lines += [f"  {i}. {c}" for i, c in enumerate(entry[2], 1)]
        if "m" in f:
            api = f" via {f['api']}" if f.get("api") else ""
            lines.append(
                f"call ({f.get('purpose')}{api}): transa={f.get('transa')} transb={f.get('transb')} "
                f"m={f.get('m')} n={f.get('n')} k={f.get('k')} lda={f.get('lda')} "
                f"ldb={f.get('ldb')} ldc={f.get('ldc')}"
                + (f" alpha={f.get('alpha')} beta={f.get('beta')}" if "alpha" in f else "")
            )
        if f.get("data_type"):
            lines.append(f"data type: {f['data_type']}, compute type: {f.get('compute_type')}")
        if f.get("chunk"):
            lines.append(f"piece of a split GEMM: {f['chunk']}")
        if f.get("math_mode"):
            lines.append(f"math mode: {f.get('math_mode')}")
        for op in ("a", "b", "c"):
            if f"{op}_shape" in f:
                role = f" ({f[f'{op}_role']})" if f.get(f"{op}_role") else ""
                lines.append(
                    f"operand {op.upper()}{role}: shape {_shape(f.get(f'{op}_shape'))} strides "
                    f"{_shape(f.get(f'{op}_strides'))} {_dtype(f.get(f'{op}_dtype'))} on "
                    f"{f.get(f'{op}_device')}, {f.get(f'{op}_alignment')}-byte aligned"
                )
        if f.get("device"):
            lines.append(f"device: {f.get('device')}")
        memory = _memory_line(f)
        if memory:
            lines.append(memory)
        if f.get("detail"):
            lines.append(f"detail: {f.get('detail')}")
        lines += _watch_lines(f)
        return lines

    def _next_steps(self) -> list[str]:
        entry = CUBLAS_STATUS.get(self.status)
        steps = list(entry[3]) if entry else ["run `python -m cublas_guard_ext doctor`"]
        data_type = str(self.fields.get("data_type", ""))
        if self.status in (8, 15) and data_type in ("CUDA_R_16BF", "CUDA_R_16F"):
            # NOT_SUPPORTED / ARCH_MISMATCH in half precision: the GPU or the cuBLAS build.
            steps.insert(
                0,
                "bfloat16 GEMMs need compute capability 8.0+ (float16: 5.3+); on an older GPU "
                "use float16 or float32; if fp32 works but every fp16/bf16 GEMM fails, check "
                "that torch's bundled cuBLAS matches the CUDA runtime (`doctor`)",
            )
        return steps


class PendingCudaError(GuardError, RuntimeError):
    """An earlier kernel's asynchronous CUDA error, seen before this layer's GEMM."""

    kind = "pending_cuda"
    with_environment = True

    def _headline(self) -> str:
        f = self.fields
        if f.get("op"):  # re-raised by watch() from an op it observed
            return (
                f"watch: {f.get('op')} {_where(f)} ({f.get('phase')}) failed with a CUDA error "
                f"({f.get('cuda_error_string')}); the usual cause is an EARLIER kernel"
            )
        return (
            f"layer {_layer(f.get('layer'))}: an EARLIER CUDA kernel failed "
            f"({f.get('cuda_error')}: {f.get('cuda_error_string')}); this Linear did not cause it"
        )

    def _details(self) -> list[str]:
        f = self.fields
        lines = [
            f"seen {f.get('stage')}",
            "usual culprits: an index out of range in nn.Embedding, torch.gather/index_select "
            "or a loss (e.g. a class label >= num_classes in cross_entropy): a device-side "
            "assert",
        ]
        if f.get("sticky", True):
            lines.append(
                "the CUDA context is now unusable: every later CUDA call fails; restart the process"
            )
        return lines + _watch_lines(f)

    def _next_steps(self) -> list[str]:
        if self.fields.get("launch_blocking"):
            return [
                "CUDA_LAUNCH_BLOCKING=1 is already set: the failing kernel is the last CUDA op "
                "before this layer; check its indices"
            ]
        return [
            "rerun with CUDA_LAUNCH_BLOCKING=1 to have the error raised at the line that failed",
            "check embedding/label indices: assert idx.min() >= 0 and idx.max() < num_embeddings",
        ]


class CudaLaunchError(GuardError, RuntimeError):
    """A guard kernel failed to launch (e.g. no kernel image for this GPU)."""

    kind = "cuda_launch"
    with_environment = True

    def _headline(self) -> str:
        f = self.fields
        return (
            f"layer {_layer(f.get('layer'))}: launching {f.get('kernel')} failed: "
            f"{f.get('cuda_error')} ({f.get('cuda_error_string')})"
        )

    def _details(self) -> list[str]:
        f = self.fields
        lines = []
        if f.get("built_archs"):
            lines.append(
                f"this extension was built for compute capabilities {f.get('built_archs')} "
                "(x100)"
            )
        if f.get("device_name"):
            lines.append(
                f"the GPU: {f.get('device_name')}, compute capability "
                f"{f.get('compute_capability')}"
            )
        return lines

    def _next_steps(self) -> list[str]:
        if self.fields.get("cuda_error") == "cudaErrorNoKernelImageForDevice":
            cc = str(self.fields.get("compute_capability", "X.Y"))
            return [
                f"rebuild for this GPU: TORCH_CUDA_ARCH_LIST={cc} pip install "
                "--no-build-isolation -e ."
            ]
        return ["run `python -m cublas_guard_ext doctor`"]


class GraphCaptureError(GuardError, RuntimeError):
    """Sync mode inside CUDA graph capture (it must read results on the host)."""

    kind = "graph_capture"

    def _headline(self) -> str:
        return (
            f"layer {_layer(self.fields.get('layer'))}: mode='sync' cannot run inside CUDA graph "
            "capture (it reads the scan result on the host before the GEMM)"
        )

    def _details(self) -> list[str]:
        return []

    def _next_steps(self) -> list[str]:
        return [
            "capture with mode='async' (errors are reported at cublas_guard_ext.check()) or "
            "mode='off'"
        ]


class OutOfMemoryError(GuardError, torch.OutOfMemoryError):
    """GPU memory ran out where cuBLAS or the guard needed it."""

    kind = "out_of_memory"
    with_environment = True

    def _headline(self) -> str:
        f = self.fields
        request = f" ({_bytes(f['bytes_requested'])} requested)" if f.get("bytes_requested") else ""
        return f"layer {_layer(f.get('layer'))}: out of GPU memory for {f.get('stage')}{request}"

    def _details(self) -> list[str]:
        f = self.fields
        lines = []
        memory = _memory_line(f)
        if memory:
            lines.append(memory)
        if f.get("device"):
            lines.append(f"device: {f.get('device')}")
        if f.get("detail"):
            lines.append(f"detail: {f.get('detail')}")
        return lines

    def _next_steps(self) -> list[str]:
        return [
            "lower the batch size",
            "call torch.cuda.empty_cache() before the failing step (cuBLAS allocates outside "
            "torch's cache)",
            "give cuBLAS a smaller workspace: CUBLAS_WORKSPACE_CONFIG=:4096:8",
            "look for other processes on the GPU: nvidia-smi",
        ]


class CublasOutOfMemoryError(OutOfMemoryError, CublasError):
    """cuBLAS failed for memory: ALLOC_FAILED, or NOT_INITIALIZED creating its handle.

    Both an :class:`OutOfMemoryError` (so ``torch.OutOfMemoryError`` handlers
    catch it) and a :class:`CublasError` (``.status``, the call's arguments).
    """

    kind = "cublas_out_of_memory"

    def _headline(self) -> str:
        return CublasError._headline(self)

    def _details(self) -> list[str]:
        return CublasError._details(self)

    def _next_steps(self) -> list[str]:
        return OutOfMemoryError._next_steps(self)


def _fold_inputs(fields: dict[str, Any]) -> None:
    """The native report's input0_shape, input1_dtype, ... -> input_shapes, input_dtypes, ..."""
    count = fields.pop("num_inputs", None)
    if count is None:
        return
    for part in ("name", "shape", "strides", "dtype", "device"):
        values = [fields.pop(f"input{i}_{part}", None) for i in range(int(count))]
        key = "input_names" if part == "name" else f"input_{part}" if part == "strides" else f"input_{part}s"
        fields[key] = [_dtype(v) for v in values] if part == "dtype" else values


def _coords(index: Any, shape: Any) -> list[int] | None:
    if index is None or shape is None or int(index) < 0:
        return None
    coords, rest = [], int(index)
    for size in reversed(list(shape)):
        coords.append(rest % size if size else 0)
        rest = rest // size if size else 0
    return coords[::-1]


def _where(f: dict[str, Any]) -> str:
    if "module" not in f:
        return "outside the watched model's modules"
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


class _WatchFinding:
    """What the two watch findings share: the first bad element's coordinates, the counts."""

    def __init__(self, message: str | None = None, **fields: Any) -> None:
        self._prepare(fields)
        if "first_bad_coords" not in fields:
            fields["first_bad_coords"] = _coords(fields.get("first_bad_index"), fields.get("shape"))
        super().__init__(message, **fields)  # type: ignore[call-arg]

    def _prepare(self, fields: dict[str, Any]) -> None:
        pass


def _counts_text(f: dict[str, Any]) -> str:
    return f"{f.get('nan_count')} NaN, {f.get('posinf_count')} +Inf, {f.get('neginf_count')} -Inf"


def _first_bad_line(f: dict[str, Any], name: str) -> str:
    """'first bad element: flat index i = name[c0, c1]' (watch errors)."""
    line = f"first bad element: flat index {f.get('first_bad_index')}"
    if f.get("first_bad_coords") is not None:
        line += f" = {name}[{', '.join(str(c) for c in f['first_bad_coords'])}]"
    return line


class NonFiniteOutputError(_WatchFinding, GuardError, ValueError):
    """An op inside a ``watch`` block produced NaN/+Inf/-Inf from finite inputs."""

    kind = "non_finite_output"

    def _prepare(self, fields: dict[str, Any]) -> None:
        _fold_inputs(fields)

    def _headline(self) -> str:
        f = self.fields
        return (
            f"watch: {f.get('op')} {_where(f)} ({f.get('phase', 'forward')}) produced "
            f"{_counts_text(f)} from finite inputs"
        )

    def _details(self) -> list[str]:
        f = self.fields
        first = _first_bad_line(f, "output")
        if f.get("first_bad_value") is not None:
            first += f" ({_value_name(f.get('first_bad_value'))})"
        lines = [first, f"output: shape {_shape(f.get('shape'))} {_dtype(f.get('dtype'))} on {f.get('device')}"]
        inputs = _inputs_line(f)
        if inputs:
            lines.append(inputs)
        if f.get("backward_node"):
            lines.append(f"in backward, computing {f['backward_node']} (the gradient of that module's forward)")
        if f.get("deferred"):
            lines.append(
                "recorded at that op (mode='async') and reported now: outputs computed since then "
                "are not to be trusted"
            )
        return lines

    def _next_steps(self) -> list[str]:
        op = str(self.fields.get("op", "")).split(".")
        base = op[1] if len(op) > 1 else ""
        steps = []
        hint = _PRODUCER_HINTS.get(base.rstrip("_")) or _PRODUCER_HINTS.get(base.split("_")[0])
        if hint:
            steps.append(f"likely {hint}")
        steps.append(
            "if these values are intended there, pass the op or the module to watch(..., allow=[...])"
        )
        return steps


class NonFiniteEntryError(_WatchFinding, NonFiniteInputError):
    """A watched model's argument, parameter or buffer held NaN/Inf when it entered the model."""

    kind = "non_finite_entry"

    def _headline(self) -> str:
        f = self.fields
        return (
            f"watch: the model's {f.get('role')} '{f.get('name')}' has {_counts_text(f)} on entry "
            "(it came into the model non-finite; no op inside produced it)"
        )

    def _details(self) -> list[str]:
        f = self.fields
        return [_first_bad_line(f, str(f.get("name"))), f"shape {_shape(f.get('shape'))} {_dtype(f.get('dtype'))}"]

    def _next_steps(self) -> list[str]:
        if self.fields.get("role") in ("parameter", "buffer"):
            return [
                "the parameters diverged or were loaded broken: lower the learning rate, clip "
                "gradients, or reload the last good checkpoint",
                "an intended -inf buffer (a mask): pass its name to watch(..., allow=[...])",
            ]
        return ["check the data pipeline: the batch was already non-finite"]


class ExtensionBuildError(GuardError, ImportError):
    """The native extension could not be loaded or built."""

    kind = "build"

    def _headline(self) -> str:
        return f"cublas_guard_ext: native extension unavailable: missing {self.fields.get('missing')}"

    def _details(self) -> list[str]:
        return [str(self.fields.get("detail", ""))]

    def _next_steps(self) -> list[str]:
        return [str(self.fields.get("fix", "see the README's build section"))]


_BY_KIND: dict[str, type[GuardError]] = {
    cls.kind: cls
    for cls in (
        DTypeError,
        ShapeMismatchError,
        DeviceMismatchError,
        NonFiniteInputError,
        NonFiniteOutputError,
        NonFiniteEntryError,
        SizeLimitError,
        CublasError,
        PendingCudaError,
        CudaLaunchError,
        GraphCaptureError,
        OutOfMemoryError,
        CublasOutOfMemoryError,
    )
}


def parse_payload(message: str) -> dict[str, Any] | None:
    """The structured fields in a native error message, or None."""
    match = _PAYLOAD_RE.search(message)
    if match is None:
        return None
    try:
        payload = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    return payload if isinstance(payload, dict) else None


def from_payload(payload: dict[str, Any]) -> GuardError:
    """Build the typed error for a payload dict (``kind`` selects the class)."""
    fields = dict(payload)
    kind = fields.pop("kind", "guard")
    for key, value in fields.items():  # c10's dtype names -> torch's ("Double" -> "torch.float64")
        if key == "dtype" or key.endswith("_dtype"):
            fields[key] = _dtype(value)
    if kind == "cublas" and (
        fields.get("status") == 3 or (fields.get("status") == 1 and fields.get("stage") == "handle")
    ):
        kind = "cublas_out_of_memory"  # ALLOC_FAILED, or NOT_INITIALIZED creating the handle
    cls = _BY_KIND.get(kind, GuardError)
    return cls(**fields)


def from_native(exc: BaseException) -> GuardError | None:
    """The typed error for a native exception, or None if it is not one of ours."""
    payload = parse_payload(str(exc))
    return None if payload is None else from_payload(payload)


# The errors a failure capsule is written for: the cuBLAS side of a call.
_CAPTURED = (CublasError, PendingCudaError, CudaLaunchError)


def attach_capsule(err: GuardError, native: dict[str, Any] | None = None) -> GuardError:
    """Writes the failure capsule of a cuBLAS-side error raised by a guarded call or watch.

    Sets ``err.capsule`` (the path, or None) and puts the path, or why there is none, in
    the message. Never raises and never changes anything else about the error.
    """
    if not isinstance(err, _CAPTURED):
        return err
    path, note = _capsule.capture(err, native)
    if path is None and note is None:  # capture is off
        return err
    err.capsule, err.capsule_note = path, note
    err.args = (err._format(),)
    return err


def _typed_from_native_message(message: str, native: dict[str, Any] | None = None) -> GuardError | None:
    """Called by the native library (python_errors.cpp) to build the exception it raises.

    ``native``: the tensors of the failing call (the GEMM's buffers, the guarded call's
    operands), its phase and number, for the failure capsule.
    """
    payload = parse_payload(message)
    if payload is None:
        return None
    return attach_capsule(from_payload(payload), native)
