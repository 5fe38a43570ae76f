"""What the stable core cannot do in C++, done in Python when the core is the loaded library.

The stable C ABI registers kernels only: no C++ autograd, no autocast kernels, no SymInts for
Meta kernels, and only ``std::runtime_error`` crosses it. So, for the core alone, this module
registers:

* autograd for the three GEMM ops (``torch.library.register_autograd``), the formulas of
  csrc/locked/linear/autograd.cpp: closed under differentiation, so double backward works;
* autocast for ``linear`` on CPU and CUDA, csrc/locked/linear/autocast.cpp's rule: the eligible
  floating arguments cast to the autocast dtype in effect *at run time*, float64 left alone;
* fake kernels (``torch.library.register_fake``) for torch.compile and torch.export: the output
  shapes, with symbolic sizes kept symbolic (the argument rules run in the real kernel);

and turns the core's errors back into the package's typed exceptions (``typed_errors``): the
payload line names the kind (errors/parse.py), a ``[ValueError] ``/``[TypeError] `` prefix the
built-in class of a plain misuse error (csrc/core/tensor_api.h), and the failing call's tensors
wait in the core until taken here (csrc/report/raise_stable.cpp), for the failure capsule.

The version-locked library registers all of this in C++; this module is never imported then.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..loading import codes as _codes

_VALUE_TAG = "[ValueError] "  # csrc/core/tensor_api.h's kValueErrorTag
_TYPE_TAG = "[TypeError] "  # ... kTypeErrorTag
_PAYLOAD_MARKER = "[cublas_guard_ext payload] "  # csrc/linear/linear_op.h's kPayloadMarker

_registered = False
_library: torch.library.Library | None = None

F = TypeVar("F", bound=Callable[..., Any])


def translate(exc: BaseException) -> BaseException | None:
    """The typed exception a core error stands for, or None when it is not one of ours."""
    message = str(exc)
    if _PAYLOAD_MARKER in message:
        from ...errors import parse  # late: errors sits above _native

        return parse._typed_from_native_message(message, _take_failure_context())
    for tag, cls in ((_VALUE_TAG, ValueError), (_TYPE_TAG, TypeError)):
        at = message.find(tag)
        if at >= 0:
            return cls(message[at + len(tag) :])
    return None


def typed_errors(fn: F) -> F:
    """``fn`` with the core's errors raised as the typed exceptions the locked library raises."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            typed = translate(exc)
            if typed is None:
                raise
            raise typed.with_traceback(exc.__traceback__) from None

    return wrapper  # type: ignore[return-value]


def _take_failure_context() -> dict[str, Any]:
    """The failing call's tensors and facts, as python_errors.cpp hands them to the capsule."""
    internal = torch.ops.cublas_guard_internal
    if not hasattr(internal, "failure_names"):  # not the stable core: nothing kept
        return {"buffers": {}, "operands": {}}
    names = list(internal.failure_names())
    tensors = list(internal.take_failure_tensors())
    context: dict[str, Any] = {"buffers": {}, "operands": {}}
    for name in names:
        kind, _, value = name.partition(":")
        if kind == "phase":
            context["phase"] = value
        elif kind == "call_number":
            context["call_number"] = int(value)
    for name, tensor in zip(names, tensors):
        kind, _, value = name.partition(":")
        context["buffers" if kind == "buffer" else "operands"][value] = tensor
    return context


# ---------------------------------------------------------------------------
# Autograd (csrc/locked/linear/autograd.cpp's formulas), as the Autograd kernel of each op: every
# call of the op on ordinary tensors passes it (torch.ops.cublas_guard.* called directly
# too), so it is also where the core's errors become typed, forward and backward alike.
# ---------------------------------------------------------------------------
_ops = torch.ops.cublas_guard
_LINEAR = _ops.linear.default


def _broadcast_in_memory(t: torch.Tensor) -> bool:
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))


def _saved_if(needed: bool, t: torch.Tensor) -> torch.Tensor | None:
    return t if needed else None


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, keyset, x, weight, bias, layer, mode, scan_grad):  # noqa: ANN001, ANN205
        # Like nn.Linear, only what the needed gradients read: dW = g^T x needs x, dx = g W needs W.
        ctx.save_for_backward(_saved_if(weight.requires_grad, x), _saved_if(x.requires_grad, weight))
        ctx.layer, ctx.has_bias = layer, bias is not None
        ctx.grad_mode = mode if scan_grad else _codes.MODE_OFF
        if keyset is None and _direct.linear is not None:  # from the C entry: no mode on, and
            out = _direct.linear(x, weight, bias, layer, mode, scan_grad)  # gradients off here
            if out is not None:
                return out
        return _below_autograd(_ops.linear.default, keyset, x, weight, bias, layer, mode, scan_grad)

    @staticmethod
    @typed_errors  # the engine re-raises a Python exception from a backward as it is
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        # A gradient broadcast from a reduction arrives with zero strides: copy it once for both GEMMs.
        if need_x and need_w and _broadcast_in_memory(grad):
            grad = grad.contiguous()
        if ctx.grad_mode != _codes.MODE_OFF:
            _call(
                _ops.guard_values.default,
                _direct.guard_values,
                grad,
                ctx.layer,
                _codes.ROLE_GRAD_OUTPUT,
                ctx.grad_mode,
            )
        grad_x = (
            _call(_ops.linear_grad_input.default, _direct.grad_input, grad, weight, ctx.layer)
            if need_x
            else None
        )
        grad_w = (
            _call(_ops.linear_grad_weight.default, _direct.grad_weight, grad, x, ctx.layer)
            if need_w
            else None
        )
        grad_b = None
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_b = grad.sum(tuple(range(grad.dim() - 1))) if grad.dim() > 1 else grad.clone()
        return None, grad_x, grad_w, grad_b, None, None, None


class _GradInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, keyset, grad_output, weight, layer):  # noqa: ANN001, ANN205
        ctx.save_for_backward(
            _saved_if(weight.requires_grad, grad_output), _saved_if(grad_output.requires_grad, weight)
        )
        ctx.layer = layer
        return _below_autograd(_ops.linear_grad_input.default, keyset, grad_output, weight, layer)

    @staticmethod
    @typed_errors  # the engine re-raises a Python exception from a backward as it is
    def backward(ctx, dgi):  # noqa: ANN001, ANN205
        # gi = g W:  dg = dgi W^T = linear(dgi, W);  dW = g^T dgi = grad_weight(g, dgi)
        g, weight = ctx.saved_tensors
        off = _codes.MODE_OFF
        dg = (
            _ops.linear.default(dgi, weight, None, ctx.layer, off, False) if ctx.needs_input_grad[1] else None
        )
        dw = _ops.linear_grad_weight.default(g, dgi, ctx.layer) if ctx.needs_input_grad[2] else None
        return None, dg, dw, None


class _GradWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, keyset, grad_output, x, layer):  # noqa: ANN001, ANN205
        ctx.save_for_backward(
            _saved_if(x.requires_grad, grad_output), _saved_if(grad_output.requires_grad, x)
        )
        ctx.layer = layer
        return _below_autograd(_ops.linear_grad_weight.default, keyset, grad_output, x, layer)

    @staticmethod
    @typed_errors  # the engine re-raises a Python exception from a backward as it is
    def backward(ctx, dgw):  # noqa: ANN001, ANN205
        # gw = g^T x:  dg = x dgw^T = linear(x, dgw);  dx = g dgw = grad_input(g, dgw)
        g, x = ctx.saved_tensors
        off = _codes.MODE_OFF
        dg = _ops.linear.default(x, dgw, None, ctx.layer, off, False) if ctx.needs_input_grad[1] else None
        dx = _ops.linear_grad_input.default(g, dgw, ctx.layer) if ctx.needs_input_grad[2] else None
        return None, dg, dx, None


def _untracked_inference_weight(weight: torch.Tensor) -> bool:
    """nn.Linear reads its weight through weight.t(): outside inference mode, a view of an
    inference tensor is not tracked, so such a weight gets no gradient there (its bias does).
    The same here (csrc/locked/linear/autograd.cpp)."""
    return weight.is_inference() and weight.requires_grad and not torch.is_inference_mode_enabled()


def _below_autograd(op: Any, keyset: Any, *args: Any) -> Any:
    with torch._C._AutoDispatchBelowAutograd():
        if keyset is None:  # called from Python directly (fast_linear), not from the dispatcher
            return op(*args)
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)


def _call(op: Any, direct: Callable[..., Any] | None, *args: Any) -> Any:
    """A backward formula's op: straight below autograd unless a gradient of it is recorded
    (create_graph), which only the dispatcher's Autograd kernel records; below autograd, its
    kernel from C where the core has the C entry and nothing else would see the op (``direct``
    answers NotImplemented otherwise)."""
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
        return op(*args)
    if direct is not None:
        out = direct(*args)
        if out is not NotImplemented:
            return out
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


class _DirectKernels:
    """The C entry's calls of the ops' kernels (csrc/python_entry_stable.cpp), once installed."""

    linear: Callable[..., Any] | None = None
    grad_input: Callable[..., Any] | None = None
    grad_weight: Callable[..., Any] | None = None
    guard_values: Callable[..., Any] | None = None


_direct = _DirectKernels()


# ---------------------------------------------------------------------------
# The fast eager entry under the core (the locked library's is C++: csrc/locked/python_module.cpp):
# SafeLinear's call goes straight to the autograd node or below autograd, without the
# dispatcher's round trip through the Python Autograd kernel (about 9 us of a 16x16 call).
# The caller (guarded_linear/ops.py's fast_linear) has ruled out torch.compile and torch.func.
# ---------------------------------------------------------------------------
_cuda_devices_seen: set[int] = set()
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def cuda_first_use_done(index: int) -> None:
    """The package ran its first-use diagnostics for CUDA device ``index``."""
    _cuda_devices_seen.add(index)


# Looked up once: every name below is read on every guarded call.
_function_mode_on = torch._C._is_torch_function_mode_enabled
_tracing = torch._C._is_tracing  # what torch.jit.is_tracing reads, without its Python frame
_autocast_on = torch.is_autocast_enabled
_grad_on = torch.is_grad_enabled
_below = torch._C._AutoDispatchBelowAutograd
_strided = torch.strided
_DEVICES = ("cpu", "cuda")


def fast_linear(*args: Any) -> torch.Tensor | None:
    """The guarded linear of (x, weight, bias, layer, code, scan_grad), or None when the
    torch.ops path must decide (as the C++ entry: arguments of other types, tensor subclasses,
    torch function modes, autocast, the JIT tracer, non-strided input, a CUDA device before its
    first-use diagnostics, the default mode to read)."""
    if len(args) != 6:
        return None
    x, weight, bias, layer, code, scan_grad = args
    if (
        type(x) not in _PLAIN
        or type(weight) not in _PLAIN
        or (bias is not None and type(bias) not in _PLAIN)
        or type(layer) is not str
        or type(code) is not int
        or not 0 <= code < 2**63  # the op refuses other codes itself, with their ValueError
        or type(scan_grad) is not bool
        or x.layout is not _strided
        or _function_mode_on()
        or _tracing()
    ):
        return None
    device = x.device.type
    if device not in _DEVICES or _autocast_on(device):
        return None
    if device == "cuda":
        if x.device.index not in _cuda_devices_seen:
            return None
        if x.dtype in _HALF:
            hand_over_cuda_settings()
    if _grad_on() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _grad_path(x, weight, bias, layer, code, scan_grad)
    try:
        with _below():
            return _LINEAR(x, weight, bias, layer, code, scan_grad)
    except RuntimeError as exc:
        typed = translate(exc)
        if typed is None:
            raise
        raise typed.with_traceback(exc.__traceback__) from None


@typed_errors
def _grad_path(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: str, code: int, scan_grad: bool
) -> torch.Tensor:
    """The fast entry's call that records a gradient: the autograd node, directly."""
    if _untracked_inference_weight(weight):
        weight = weight.detach()
    return _Linear.apply(None, x, weight, bias, layer, code, scan_grad)


def _error_from_core(message: str) -> BaseException:
    """The exception the C entry raises for the core's ``message`` (the typed one if ours)."""
    return translate(RuntimeError(message)) or RuntimeError(message)


def c_entry(library_path: str) -> tuple[Callable[..., Any], Callable[[int], None]] | None:
    """The core's C entry (csrc/python_entry_stable.cpp): its ``fast_linear`` and
    ``cuda_first_use_done``, taking the same decisions as this module's twins without their
    Python frames, or None where torch lacks the stable ABI's Python interop shims (before
    2.14) or the library has no C entry. CUBLAS_GUARD_EXT_CORE_ENTRY=python keeps the twins."""
    import ctypes
    import os

    if os.environ.get("CUBLAS_GUARD_EXT_CORE_ENTRY", "") == "python":
        return None
    try:
        make = ctypes.PyDLL(library_path).cublas_guard_core_python_entry
    except (OSError, AttributeError):  # a core built before the entry existed
        return None
    make.restype, make.argtypes = ctypes.py_object, [ctypes.py_object]
    hooks = (
        torch.Tensor,
        torch.nn.Parameter,
        _function_mode_on,
        _tracing,
        torch._C._len_torch_dispatch_stack,
        torch._C._is_any_autocast_enabled,
        _grad_path,
        _error_from_core,
        hand_over_cuda_settings,
    )
    entries = make(hooks)
    if entries is None:
        return None
    fast, first_use, _direct.grad_input, _direct.grad_weight, _direct.guard_values = entries
    _direct.linear = fast
    return fast, first_use


# torch's cuBLAS settings for half-precision GEMMs, which the stable ABI cannot read: handed
# to the core (gemm_route.cpp's atomics) before a CUDA fp16/bf16 GEMM when they changed.
_HALF = (torch.float16, torch.bfloat16)
_handed_over: tuple[int, int, bool] | None = None


def _reduction_option(matmul: Any, dtype_name: str) -> int:
    """at::CuBLASReductionOption's value: 0 reduced precision with split-K, 1 split-K only, 2 neither."""
    if getattr(matmul, f"allow_{dtype_name}_reduced_precision_reduction", True):
        return 0
    return 1 if getattr(matmul, f"allow_{dtype_name}_reduced_precision_reduction_split_k", True) else 2


def hand_over_cuda_settings() -> None:
    global _handed_over
    matmul = torch.backends.cuda.matmul
    settings = (
        _reduction_option(matmul, "fp16"),
        _reduction_option(matmul, "bf16"),
        bool(getattr(matmul, "allow_fp16_accumulation", False)),
    )
    if settings != _handed_over:
        internal = torch.ops.cublas_guard_internal
        internal.set_reduction_options.default(settings[0], settings[1])
        internal.set_fp16_accumulation.default(settings[2])
        _handed_over = settings


def _autograd_kernel(
    op: Any, function: type[torch.autograd.Function] | None, defaults: tuple
) -> Callable[..., Any]:
    """The Autograd kernel of ``op``: a node only when a gradient will be recorded (never for
    an op without gradients, ``function`` None: the scans and checks)."""
    n_args = len(op._schema.arguments)

    def kernel(keyset, *args):  # noqa: ANN001, ANN202
        args = args + defaults[len(args) - (n_args - len(defaults)) :] if len(args) < n_args else args
        if torch.autograd.forward_ad._current_level >= 0 and any(
            isinstance(a, torch.Tensor) and torch.autograd.forward_ad.unpack_dual(a).tangent is not None
            for a in args
        ):
            raise RuntimeError(
                f"cublas_guard_ext: jvp is not implemented for {op} (forward-mode AD): "
                "torch.func.jvp on SafeLinear uses the package's own formulas"
            )
        try:
            first = args[0]
            if first.is_cuda and first.dtype in _HALF:
                hand_over_cuda_settings()
            if function is not None and torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
                if function is _Linear and _untracked_inference_weight(args[1]):
                    args = (args[0], args[1].detach(), *args[2:])
                return function.apply(keyset, *args)
            return _below_autograd(op, keyset, *args)
        except RuntimeError as exc:
            typed = translate(exc)
            if typed is None:
                raise
            raise typed.with_traceback(exc.__traceback__) from None

    return kernel


# ---------------------------------------------------------------------------
# Autocast (csrc/locked/linear/autocast.cpp's rule)
# ---------------------------------------------------------------------------
def _autocast_kernel(device_type: str, op: Any, positions: tuple[int, ...]) -> Callable[..., torch.Tensor]:
    """``op``'s Autocast kernel: the floating arguments at ``positions`` cast to the autocast
    dtype in effect at run time (not one fixed at registration), float64 left alone."""
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))

    def cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        eligible = (
            t is not None
            and t.is_floating_point()
            and t.dtype != torch.float64
            and t.device.type == device_type
        )
        return t.to(dtype) if eligible and t.dtype != dtype else t

    def kernel(*args):  # noqa: ANN002, ANN202 (the op's schema)
        dtype = torch.get_autocast_dtype(device_type)
        args = tuple(cast(a, dtype) if i in positions else a for i, a in enumerate(args))
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(*args)

    return kernel


# ---------------------------------------------------------------------------
# Fake kernels: output shapes, symbolic sizes kept symbolic, and the argument rules of
# csrc/linear/checks.cpp (the core's argument_rules op): on meta tensors (weights never loaded)
# and in a trace they refuse what the real kernel refuses, with the same typed errors. The
# rules take concrete sizes (the stable ABI has no SymInt): under dynamic shapes they run on
# stand-ins of the traced example's sizes (each symbol's hint), which says of that example what
# the real kernel would, and adds no guard to the graph; a size with no hint (unbacked, as
# torch.export may make) leaves the rules to the real kernel.
# ---------------------------------------------------------------------------
def _concrete(*tensors: torch.Tensor | None) -> bool:
    return all(
        t is None or all(type(s) is int for s in (*t.shape, *t.stride()))  # noqa: E721 (SymInt is no int)
        for t in tensors
    )


def _hint(size: int | torch.SymInt) -> int | None:
    if type(size) is int:  # noqa: E721 (SymInt is no int)
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return hint if type(hint) is int else None  # noqa: E721


def _with_concrete_sizes(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or a stand-in of its example's sizes and strides (None: some size has no hint)."""
    if t is None or _concrete(t):  # never compare a SymInt: that would guard on its value
        return t
    shape, stride = [_hint(s) for s in t.shape], [_hint(s) for s in t.stride()]
    if None in shape or None in stride:
        return None
    return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)


def stand_ins(*tensors: torch.Tensor | None) -> list[torch.Tensor | None] | None:
    """What the argument rules can take for ``tensors`` (None: leave them to the real kernel)."""
    out = [_with_concrete_sizes(t) for t in tensors]
    return None if any(o is None and t is not None for o, t in zip(out, tensors)) else out


@typed_errors
def _rules(
    op: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, layer: str, mode: int
) -> None:
    concrete = stand_ins(a, b, bias)
    if concrete is not None:
        torch.ops.cublas_guard_internal.argument_rules.default(op, *concrete, layer, mode)


def _fake_scan(x: torch.Tensor) -> torch.Tensor:
    _rules("scan", x, x, None, "", 0)
    return x.new_empty((4,), dtype=torch.int64)


def _fake_linear(x, weight, bias=None, layer="", mode=_codes.MODE_SYNC, scan_grad=False):  # noqa: ANN001, ANN202
    _rules("linear", x, weight, bias, layer, mode)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=weight.dtype)


def _fake_grad_input(grad_output, weight, layer=""):  # noqa: ANN001, ANN202
    _rules("linear_grad_input", grad_output, weight, None, layer, 0)
    return grad_output.new_empty((*grad_output.shape[:-1], weight.shape[1]), dtype=weight.dtype)


def _fake_grad_weight(grad_output, x, layer=""):  # noqa: ANN001, ANN202
    _rules("linear_grad_weight", grad_output, x, None, layer, 0)
    return x.new_empty((grad_output.shape[-1], x.shape[-1]), dtype=x.dtype)


def _fake_check_features(x, in_features, layer=""):  # noqa: ANN001, ANN202
    _rules("check_features", x, x, None, layer, in_features)


def _fake_nothing(*args: Any) -> None:
    return None


def register() -> None:
    """Register the Python side of the stable core (once per process)."""
    global _registered, _library
    if _registered:
        return
    lib = "cublas_guard::"
    torch.library.register_fake(lib + "scan", _fake_scan)
    torch.library.register_fake(lib + "linear", _fake_linear)
    torch.library.register_fake(lib + "linear_grad_input", _fake_grad_input)
    torch.library.register_fake(lib + "linear_grad_weight", _fake_grad_weight)
    torch.library.register_fake(lib + "check_features", _fake_check_features)
    torch.library.register_fake(lib + "guard_values", _fake_nothing)
    _library = torch.library.Library("cublas_guard", "IMPL")
    for name, function, defaults in (
        ("linear", _Linear, (None, "", _codes.MODE_SYNC, False)),
        ("linear_grad_input", _GradInput, ("",)),
        ("linear_grad_weight", _GradWeight, ("",)),
        ("scan", None, ()),
        ("check_features", None, ("",)),
        ("guard_values", None, ()),
    ):
        op = getattr(_ops, name).default
        _library.impl(name, _autograd_kernel(op, function, defaults), "Autograd", with_keyset=True)
    for device_type in ("cpu", "cuda"):
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        _library.impl("linear", _autocast_kernel(device_type, _ops.linear.default, (0, 1, 2)), key)
    _registered = True


def library() -> torch.library.Library:
    """The Library the core's Python kernels are registered with (stable_core_grouped's too)."""
    assert _library is not None, "stable_core.register() first"
    return _library


# ---------------------------------------------------------------------------
# What needs the version-locked library (watch: a dispatcher fallback on ATen's internals)
# ---------------------------------------------------------------------------
LOCKED_BUILD_COMMAND = "python -m cublas_guard_ext build"


def locked_library_missing(what: str) -> BaseException:
    """The error for using ``what`` where only the stable core is loaded: one line saying what to run."""
    from ...errors import ExtensionBuildError  # late: errors sits above _native

    return ExtensionBuildError(
        missing="the version-locked library",
        detail=f"{what} needs cublas_guard_ext's version-locked library, which is not built for "
        f"torch {torch.__version__} (the guarded layers run on the stable core without it)",
        fix=f"run `{LOCKED_BUILD_COMMAND}` once (it compiles the library for this torch, a few "
        "minutes; it needs a C++ compiler), then restart the process",
    )


class LockedOnly:
    """Stands in for the locked library's Python module (``cublas_guard_ext._C``) under the core:
    the questions every guarded step asks ("is anything watched?") answer no; anything else
    raises ``locked_library_missing``."""

    def __init__(self, what: str) -> None:
        self._what = what

    @staticmethod
    def _watch_active() -> bool:
        return False

    @staticmethod
    def _watch_key_included() -> bool:
        return False

    @staticmethod
    def _watch_take_pending() -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise locked_library_missing(self._what)
