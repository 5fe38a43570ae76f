"""Every ``nn.Linear`` of the process through the guarded op, named by its qualified name; and
every transformers experts module (a mixture of experts' 3-D expert weights) through the guarded
grouped GEMM (:func:`cublas_guard_ext.models.experts.install_everywhere`).

``nn.Linear.forward`` is replaced on the class (modules built before and after alike; the
subclasses that keep nn.Linear's forward too; ``SafeLinear`` has its own). The replacement is
the same fast entry SafeLinear uses (:func:`cublas_guard_ext.ops.fast_linear`): checks, the
value scan in the default mode (``CUBLAS_GUARD_MODE``, which ``run --mode`` sets; ``guard()``
blocks still override it) and the checked cuBLAS call; ``torch.compile`` traces the same
``torch.ops.cublas_guard.linear`` (no dispatch mode, no global hook: nothing turns compile off).

Names cost nothing per call: a layer's name is looked up once, on its first eager call, by
walking the Python stack to the outermost module being called (the model: DDP and compile
wrappers are looked through) and naming every Linear in it (``encoder.layer.0.attention.query``).
A Linear called by no module is named after the variable that holds it in its caller, else
``Linear(in->out)``. ``torch.compile(model)`` and ``model.compile()`` name the model's layers
when they are called, so traced code has the names too.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch import nn

from ..guarded_linear import naming as _naming
from ..guarded_linear import ops as _ops
from ..models import experts as _experts
from ..training.state import _unwrap

NAME_ATTR = "_cublas_guard_run_name"
_fast_linear = _ops.fast_linear
_guarded_linear = _ops.linear
_is_compiling = torch.compiler.is_compiling
_is_exporting = torch.compiler.is_exporting
_is_tracing = torch.jit.is_tracing  # (Dynamo folds it; torch._C._is_tracing would break the graph)
_plain_linear = torch.nn.functional.linear
_CALL_CODES = _naming.MODULE_CALL_CODES
_original: dict[str, Any] = {}
# The outermost module of the latest first call: the model the report draws its tree from.
_last_root: list[weakref.ref] = []


def _fallback(linear: nn.Linear) -> str:
    return f"Linear({linear.in_features}->{linear.out_features})"


def name_layers(root: nn.Module) -> None:
    """Name every not-yet-named Linear of ``root`` (looked through DDP / compile) by its
    qualified name there."""
    model = _unwrap(root)
    for qualified, module in model.named_modules():
        if isinstance(module, nn.Linear) and NAME_ATTR not in module.__dict__:
            module.__dict__[NAME_ATTR] = qualified or _fallback(module)


def _variable_name(linear: nn.Linear, frame: Any) -> str | None:
    """The name of a local or global of ``frame`` that holds ``linear``."""
    for scope in (frame.f_locals, frame.f_globals):
        for key, value in list(scope.items()):
            if value is linear and not key.startswith("_"):
                return key
    return None


def root_of_call() -> nn.Module | None:
    """The outermost module whose call is on this thread's Python stack."""
    return _naming.outermost_module_called()


def _name_on_first_call(linear: nn.Linear) -> str:
    if _is_compiling():  # no stack to walk inside a trace: named by torch.compile's patch, else this
        return _fallback(linear)
    root = root_of_call()
    if root is not None and root is not linear:
        name_layers(root)
        _last_root[:] = [weakref.ref(_unwrap(root))]
    name = linear.__dict__.get(NAME_ATTR)
    if name is None:
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code in _CALL_CODES or frame.f_globals is globals()):
            frame = frame.f_back
        name = (_variable_name(linear, frame) if frame is not None else None) or _fallback(linear)
        linear.__dict__[NAME_ATTR] = name
    return name


def guarded_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's)
    """``nn.Linear.forward`` under ``run``: the guarded op, by the layer's qualified name.

    In a ``torch.jit.script``-ed model it is nn.Linear's own ``F.linear``: TorchScript compiles
    only this branch, and scripted code can read neither the run's mode nor the layer names."""
    if torch.jit.is_scripting():
        return torch.nn.functional.linear(input, self.weight, self.bias)
    return _eager_forward(self, input)


@torch.jit.unused
def _eager_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    name = getattr(self, NAME_ATTR, None)
    if name is None:
        name = _name_on_first_call(self)
    weight, bias = self.weight, self.bias  # read once (a parametrized weight is computed per read)
    if _is_tracing():  # torch.jit.trace / the TorchScript ONNX exporter: see below
        return _plain_linear(input, weight, bias)
    out = _fast_linear(input, weight, bias, name, None, False)
    if out is not None:
        return out
    if _is_exporting():
        # torch.export (and the ONNX exporter built on it), like torch.jit.trace above, writes an
        # artifact that must not depend on this extension: it records nn.Linear's own F.linear.
        # torch.compile traces the guarded op.
        return _plain_linear(input, weight, bias)
    return _guarded_linear(input, weight, bias, layer=name)


def last_root() -> nn.Module | None:
    return _last_root[0]() if _last_root else None


def _compile_naming(compile_fn: Any) -> Any:
    def compile(model: Any = None, *args: Any, **kwargs: Any) -> Any:  # noqa: A001 (torch's name)
        target = getattr(model, "__self__", model)  # nn.Module.compile passes its bound _call_impl
        if isinstance(target, nn.Module):
            try:
                name_layers(target)
            except Exception:  # naming is a nicety: compile must go on
                pass
        return compile_fn(model, *args, **kwargs)

    compile.__wrapped__ = compile_fn  # type: ignore[attr-defined]
    compile.__doc__ = compile_fn.__doc__
    return compile


def install() -> None:
    if _original:
        return
    _original["forward"] = nn.Linear.forward
    _original["compile"] = torch.compile
    nn.Linear.forward = guarded_forward  # type: ignore[method-assign]
    torch.compile = _compile_naming(torch.compile)  # type: ignore[assignment]
    _experts.install_everywhere()


def uninstall() -> None:
    if not _original:
        return
    _experts.uninstall_everywhere()
    nn.Linear.forward = _original.pop("forward")  # type: ignore[method-assign]
    torch.compile = _original.pop("compile")  # type: ignore[assignment]
