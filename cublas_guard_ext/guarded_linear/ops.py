"""Thin, typed wrappers over ``torch.ops.cublas_guard``.

All rules live in the native ops; these functions only pick the op and pass
the layer name and mode. Native errors arrive already typed: the native side
raises the exception class from :mod:`cublas_guard_ext.errors` itself (see
csrc/locked/report/python_errors.cpp), in forward, in backward and in compiled graphs.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._native.loading import codes as _codes
from .._native.loading import seam as _native_seam
from .._native.machine import facts
from . import modes

_seam = _native_seam.seam()
_ops = torch.ops.cublas_guard

from . import _transforms  # noqa: E402  (needs the ops loaded)

# The fast eager entry of the prebuilt library (csrc/locked/python_module.cpp): the same op
# through a typed dispatcher handle, skipping torch.ops' generic argument
# parsing. It returns None whenever the torch.ops path could behave otherwise
# (tensor subclasses, torch function modes, the JIT tracer, non-strided input,
# a CUDA device before its first-use diagnostics, a default mode it cannot
# read); callers then take that path. A JIT build (no Python module) has none.
# Under the stable core the entry is Python's, with the same rules (core_twins/stable_core.py);
# the seam (_native/loading/seam.py) says which this process has.
_fast_linear = _seam.fast_linear
_cuda_first_use_done = _seam.cuda_first_use_done
_is_compiling = torch.compiler.is_compiling
_transforms_active = _transforms.active
_blocks = modes._blocks
_MODE_CODES = modes.MODE_CODES
# The fast entry's code for "the default mode": the C++ entry reads CUBLAS_GUARD_MODE itself;
# the core's Python one is given the mode's code.
_ENV_DEFAULT = _codes.MODE_ENV_DEFAULT
_env_default_code = (
    (lambda: _ENV_DEFAULT)
    if _seam.fast_linear_reads_mode_env
    else (lambda: _MODE_CODES[modes._env_default()])
)


def fast_linear(
    x: Any, weight: Any, bias: Any, layer: str, mode: str | None, scan_grad: bool
) -> torch.Tensor | None:
    """The guarded linear through the fast entry, or None: then the torch.ops path decides.

    Taken only outside torch.compile (Dynamo must see the torch.ops call),
    torch.func transforms and forward-mode AD (they need the Python autograd
    formulas in cublas_guard_ext._transforms), for a mode given by name or the
    default; the native side refuses the rest (see above). The one place that
    decides; SafeLinear's forward calls it too.
    """
    if _fast_linear is None or _is_compiling() or _transforms_active():
        return None
    if mode is None:
        blocks = _blocks.get()
        code = _MODE_CODES[blocks[-1][1]] if blocks else _env_default_code()
    elif type(mode) is str and mode in _MODE_CODES:
        code = _MODE_CODES[mode]
    else:
        return None
    return _fast_linear(x, weight, bias, layer, code, scan_grad)


# The guards that return nothing (check_features, guard_values: the backward
# scan of scan_grad, async_check) would be dead code to torch.compile's graphs
# (Dynamo, AOTAutograd, Inductor all eliminate unused pure calls): marked
# side-effectful, they are kept and run in compiled forward and backward graphs.
for _op in (
    _ops.check_features.default,
    _ops.guard_values.default,
    _ops.async_check.default,
    torch.ops.cublas_guard_testing.set_fault.default,
):
    torch.fx.node.has_side_effect(_op)

__all__ = ["ScanResult", "scan", "linear", "check_features", "check", "guard", "DTYPE_POLICIES"]

# "strict" (default): nn.Linear's rule. float32, bfloat16, float16 and float64
#         each run natively (see docs/dtypes-and-autocast.md); input and parameters
#         of different dtypes raise DTypeError, as nn.Linear refuses them.
# "cast" (deprecated): fp16/bf16 input into a float32 layer is upcast to float32
#         (exact) and the output cast back. It predates native fp16/bf16 GEMMs;
#         torch.autocast now does the mixing the way nn.Linear does, and the
#         policy costs a float32 copy of the input and of the output per call
#         and a float32 GEMM instead of a half-precision one.
DTYPE_POLICIES = ("strict", "cast")
_CASTABLE = (torch.float16, torch.bfloat16)

CAST_POLICY_DEPRECATION = (
    "dtype_policy='cast' is deprecated: SafeLinear now computes in float32, bfloat16, float16 "
    "and float64 like nn.Linear; for mixed precision use torch.autocast (or cast the model), "
    "which SafeLinear follows exactly as nn.Linear does"
)


def validate_dtype_policy(dtype_policy: str, stacklevel: int = 3) -> str:
    """Checks a dtype_policy value; warns (FutureWarning) for the deprecated "cast"."""
    if dtype_policy not in DTYPE_POLICIES:
        raise ValueError(f"dtype_policy must be one of {DTYPE_POLICIES}, got {dtype_policy!r}")
    if dtype_policy == "cast":
        warnings.warn(CAST_POLICY_DEPRECATION, FutureWarning, stacklevel=stacklevel)
    return dtype_policy


def _require_tensor(value: Any, what: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"cublas_guard_ext: {what} must be a torch.Tensor, got {type(value).__name__}")


class ScanResult:
    """Counts of NaN, +Inf and -Inf in a tensor, and the first bad flat index.

    Creating it does not synchronize: ``tensor`` (int64[4], on the scanned
    tensor's device) is filled asynchronously. Reading a field copies it to
    the host once (a synchronization on CUDA).
    """

    __slots__ = ("tensor", "_host")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._host: list[int] | None = None

    def _values(self) -> list[int]:
        if self._host is None:
            self._host = [int(v) for v in self.tensor.tolist()]
        return self._host

    @property
    def nan_count(self) -> int:
        return self._values()[0]

    @property
    def posinf_count(self) -> int:
        return self._values()[1]

    @property
    def neginf_count(self) -> int:
        return self._values()[2]

    @property
    def first_bad_index(self) -> int:
        """Flat (row-major) index of the first non-finite element, -1 if none."""
        return self._values()[3]

    @property
    def bad_count(self) -> int:
        values = self._values()
        return values[0] + values[1] + values[2]

    @property
    def all_finite(self) -> bool:
        return self.first_bad_index < 0

    def __repr__(self) -> str:
        if self._host is None and self.tensor.device.type != "cpu":
            return f"ScanResult(pending on {self.tensor.device})"
        v = self._values()
        return (
            f"ScanResult(nan_count={v[0]}, posinf_count={v[1]}, neginf_count={v[2]}, first_bad_index={v[3]})"
        )


def scan(x: torch.Tensor) -> ScanResult:
    """One fused pass over a float32/bfloat16/float16/float64 tensor of any shape and strides."""
    _require_tensor(x, "x")
    return ScanResult(_ops.scan.default(x))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    layer: str = "",
    mode: str | None = None,
    scan_grad: bool = False,
    dtype_policy: str = "strict",
) -> torch.Tensor:
    """``F.linear`` through the guard: checks, the value scan (per ``mode``), checked cuBLAS.

    ``scan_grad``: in backward, scan the gradient arriving at this layer too,
    under the same mode (reported with role ``grad_output``).
    ``dtype_policy``: see :data:`DTYPE_POLICIES` ("cast" is deprecated).
    """
    if dtype_policy == "strict":
        out = fast_linear(x, weight, bias, layer, mode, scan_grad)
        if out is not None:
            return out
    _require_tensor(x, "x")
    if (torch.compiler.is_compiling() or torch.jit.is_tracing()) and _onnx_exporting():
        return _exported_linear(x, weight, bias)
    code = modes.MODE_CODES[modes.validate(mode) if mode is not None else modes.current()]
    if x.layout != torch.strided:
        # nn.Linear accepts sparse input and returns a dense output; so do we, from
        # a dense copy of the input (as large as the output's [.., in_features] twin).
        x = x.to_dense()
    if x.is_cuda and not torch.compiler.is_compiling():
        facts.first_cuda_use(x.device)
        if _cuda_first_use_done is not None and x.device.index is not None:
            _cuda_first_use_done(x.device.index)
    # torch.func transforms and forward-mode AD need the Python autograd path.
    op = _ops.linear.default
    if not torch.compiler.is_compiling() and _transforms.active():
        op = _transforms.linear
    if dtype_policy != "strict":
        validate_dtype_policy(dtype_policy)
        if x.dtype in _CASTABLE and weight.dtype == torch.float32:
            out = op(x.float(), weight, bias, layer, code, scan_grad)
            return out.to(x.dtype)
    return op(x, weight, bias, layer, code, scan_grad)


ONNX_EXPORT_WARNING = (
    "cublas_guard_ext: exported to ONNX as a plain linear (MatMul/Gemm): the guard's runtime "
    "checks (the NaN/Inf scans, the shape/dtype/device checks with typed errors, the checked "
    "cuBLAS call) are not part of the exported graph"
)
_onnx_warned = False


def _onnx_exporting() -> bool:
    """Whether torch.onnx.export (either exporter) is tracing now. torch.onnx is never imported
    here: when it is not loaded, no export runs."""
    onnx = sys.modules.get("torch.onnx")
    return onnx is not None and bool(onnx.is_in_onnx_export())


# Read once while Dynamo traces (what torch._dynamo.assume_constant_result sets; see modes.py).
_onnx_exporting._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _exported_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What an ONNX export records for a guarded linear: F.linear (ONNX has no op for the
    checks), after a warning once per process that the checks are not exported."""
    global _onnx_warned
    if not _onnx_warned:
        _onnx_warned = True
        warnings.warn(ONNX_EXPORT_WARNING, UserWarning, stacklevel=4)
    return torch.nn.functional.linear(x, weight, bias)


def check_features(x: torch.Tensor, in_features: int, name: str | None = None) -> None:
    """Check an input as a guarded layer with ``in_features`` would, before any GEMM: dtype,
    shape and values, fused into one pass, no prints.

    Raises :class:`DTypeError`, :class:`ShapeMismatchError`,
    :class:`NonFiniteInputError` (or, on CUDA, :class:`PendingCudaError`)
    exactly as a guarded layer with ``in_features`` would; returns None.
    Zero-size batch dims are accepted (``nn.Linear`` accepts them too).
    """
    _require_tensor(x, "x")
    if isinstance(in_features, bool) or not isinstance(in_features, int):
        raise TypeError(f"cublas_guard_ext: in_features must be an int, got {in_features!r}")
    _ops.check_features.default(x, in_features, name or "")


def check() -> None:
    """Wait for the devices and raise what any async-mode scan recorded so far.

    Also raises this thread's pending ``watch(mode="async")`` finding, if any.
    """
    if torch.compiler.is_compiling():
        _check_in_graph(torch.empty(0))
        return
    _raise_recorded()


def _raise_recorded() -> None:
    """check()'s body, eager or inside a compiled graph (typed on the core below)."""
    _ops.async_check.default(True)
    for raise_pending in _pending_watch_findings:
        raise_pending()


# check() also raises this thread's pending watch(mode="async") finding. watching/ (the floor
# above, built on these ops) hands its reader in when it loads: ops imports nothing above it.
_pending_watch_findings: list[Callable[[], None]] = []


def raise_pending_watch_findings_with(reader: Callable[[], None]) -> None:
    """Called by watching/session.py: ``reader()`` raises this thread's pending finding, if any."""
    _pending_watch_findings[:] = [reader]


@contextlib.contextmanager
def guard(mode: modes.Mode = "async", *, check_on_exit: bool = True) -> Iterator[None]:
    """Run a block with a default mode; on exit, wait for and report async findings.

    >>> with cublas_guard_ext.guard("async"):
    ...     loss = model(x).sum(); loss.backward()
    # any NaN/Inf recorded inside the block is raised here at the latest
    """
    modes.validate(mode)
    block = object()
    _blocks.set((*_blocks.get(), (block, mode)))
    try:
        yield
    finally:
        # Not ContextVar.reset: the block may end in another context than it began
        # (a generator resumed elsewhere) or after a later block began.
        _blocks.set(tuple(entry for entry in _blocks.get() if entry[0] is not block))
    # Only on a normal exit: an exception already in flight is the better report.
    if check_on_exit:
        check()


# check() inside a compiled function. `async_check` takes no tensor, so
# AOTAutograd's tracer runs it once at trace time and records nothing (the
# async findings of the graph's own layers were then never raised). This op
# takes a token tensor made where check() is called, so it is recorded in the
# graph, in program order; marked side-effectful, it is kept.
@torch.library.custom_op("cublas_guard::check_in_graph", mutates_args=())
def _check_in_graph(token: torch.Tensor) -> None:
    _raise_recorded()


@_check_in_graph.register_fake
def _(token: torch.Tensor) -> None:
    return None


torch.fx.node.has_side_effect(_ops.check_in_graph.default)


# The stable core (no version-locked library for this torch): its errors cross the stable
# ABI as RuntimeError with the payload line. The ops' Autograd kernels raise them typed
# (core_twins/stable_core.py); check() calls an op without tensors, which has none, eager or
# from a compiled graph (check_in_graph's body, looked up when it runs): the seam wraps it.
_raise_recorded = _seam.typed_errors(_raise_recorded)
