"""Mixture-of-experts routers, guarded like the experts (issue 47, point 6).

transformers' routers (Mixtral's ``MixtralTopKRouter``, Qwen2/3-MoE's, OLMoE's, gpt-oss's) hold a
2-D ``weight`` and multiply it with ``F.linear`` in their own forward: no ``nn.Linear`` for
:func:`replace_linear` to swap, so a NaN in ``model.layers.0.mlp.gate.weight`` used to be refused
a layer later, by the next guarded projection. A guarded router runs its own forward unchanged;
while that forward runs (a forward pre-hook and an always-called forward hook), a
``TorchFunctionMode`` sends the ``F.linear`` whose weight *is* the router's weight through the
guarded linear (:func:`cublas_guard_ext.guarded_linear.ops.linear`), labelled with the router's
qualified name: the same checks and typed errors as a ``SafeLinear`` (a non-finite input or
weight refused naming the router), and on the CPU the same result bit for bit (the guarded
op's GEMM is ``F.linear``'s). Every other op of the router runs as it would. Nothing runs
outside the routers' own calls.

A router that converts its weight before the product (DeepSeek-V3's
``F.linear(x.type(torch.float32), self.weight.type(torch.float32))``) multiplies a tensor made
from its weight, not the weight itself: the conversions of the weight (``type``, ``to``,
``float``, ...) during its forward are remembered, and an ``F.linear`` with one of them is guarded
the same way (the weight's values, converted).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..guarded_linear import ops as _ops

ROUTER_ATTR = "_cublas_guard_router"  # (label, mode, hook handles) on a guarded router


def is_router(module: nn.Module) -> bool:
    """A transformers-style router: a class named ``...Router`` holding a 2-D ``weight``."""
    weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
    return type(module).__name__.lower().endswith("router") and weight is not None and weight.dim() == 2


def is_guarded_router(module: nn.Module) -> bool:
    return ROUTER_ATTR in module.__dict__


class _GuardedProduct(TorchFunctionMode):
    """During one router forward: its ``F.linear`` with its own weight goes through the guard."""

    def __init__(self, router: nn.Module, label: str, mode: str | None) -> None:
        super().__init__()
        self.router, self.label, self.mode = router, label, mode
        self.converted: list[torch.Tensor] = []  # the weight's conversions in this forward

    def _is_weight(self, t: Any) -> bool:
        return t is self.router._parameters.get("weight") or any(t is c for c in self.converted)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if self._is_weight(weight) and isinstance(x, torch.Tensor):
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return _ops.linear(x, weight, bias, layer=self.label, mode=self.mode)
        out = func(*args, **kwargs)
        if func in _CONVERSIONS and args and args[0] is self.router._parameters.get("weight"):
            if isinstance(out, torch.Tensor) and out.dim() == 2:
                self.converted.append(out)  # kept for this forward only (the mode is per call)
        return out


# A weight's conversions a router may multiply instead of the weight (DeepSeek-V3's .type).
_CONVERSIONS = frozenset(
    {
        torch.Tensor.type,
        torch.Tensor.to,
        torch.Tensor.float,
        torch.Tensor.bfloat16,
        torch.Tensor.half,
        torch.Tensor.double,
        torch.Tensor.contiguous,
    }
)


def _pre(label: str, mode: str | None) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        product = _GuardedProduct(module, label, mode)
        product.__enter__()
        module.__dict__.setdefault("_cublas_guard_router_modes", []).append(product)

    return hook


def _post(module: nn.Module, args: Any, output: Any) -> None:
    stack = module.__dict__.get("_cublas_guard_router_modes")
    if stack:
        stack.pop().__exit__(None, None, None)


def guard_routers(model: nn.Module, mode: str | None = None) -> list[str]:
    """Guard every router of ``model`` (qualified names returned); already guarded ones stay."""
    guarded = []
    for name, module in model.named_modules():
        if is_router(module) and not is_guarded_router(module):
            handles = (
                module.register_forward_pre_hook(_pre(name, mode)),
                module.register_forward_hook(_post, always_call=True),
            )
            module.__dict__[ROUTER_ATTR] = (name, mode, handles)
            guarded.append(name)
    return guarded


def restore_routers(model: nn.Module) -> None:
    """Undo :func:`guard_routers`: the hooks removed, the routers as they were."""
    for module in model.modules():
        state = module.__dict__.pop(ROUTER_ATTR, None)
        if state is not None:
            for handle in state[2]:
                handle.remove()
            module.__dict__.pop("_cublas_guard_router_modes", None)
