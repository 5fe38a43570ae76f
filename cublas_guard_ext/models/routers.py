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

After the guarded product the logits' absmax is compared with a threshold for their dtype
(:data:`LIMITS`): above it, :class:`~cublas_guard_ext.errors.routers.RouterLogitsWarning`, once per
router, before anything overflows (a ``RouterLogitsError`` when strict). The check follows the
router's guard mode: ``off`` reads nothing; on the CPU, and in ``sync`` mode on CUDA (which
synchronizes for the product's scan already), the stats are read at once; in ``async`` mode on
CUDA they are copied without blocking and read at the router's next call whose copy has landed.
Under ``torch.compile`` the check is an op of the graph
(``cublas_guard_internal::router_logits_check``) that runs the same check on the logits the
compiled code computed.
"""

from __future__ import annotations

import math
import os
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors.routers import RouterLogitsError, RouterLogitsWarning, router_logits_message
from ..guarded_linear import modes as _modes
from ..guarded_linear import ops as _ops
from ..guarded_linear.ao_quantization import _user_stacklevel

ROUTER_ATTR = "_cublas_guard_router"  # (label, mode, hook handles) on a guarded router
LOGITS_ATTR = "_cublas_guard_router_logits"  # _LogitsState of a guarded router
STRICT_ENV = "CUBLAS_GUARD_ROUTER_STRICT"

# The logits' absmax above which a router warns, by dtype. float16: 8, 3.1 below ln(65504) = 11.09
# where exp overflows it. Every other dtype: 32, far below exp's overflow (88.72 for bfloat16 and
# float32) but where bfloat16's spacing is 0.25, so exp(logit) is off by up to 12.5% (the roundoff
# ST-MoE's z-loss was made to prevent), and a top-1 gap of even half of it routes one-hot. Clean
# training of the tiny Mixtral and Qwen3-MoE of tests/moe peaks at 4.0 and 5.4 (docs/moe.md).
DEFAULT_THRESHOLDS = {torch.float16: 8.0}
DEFAULT_THRESHOLD = 32.0


@dataclass
class RouterLimits:
    """``threshold``: one value for every dtype (None: :data:`DEFAULT_THRESHOLDS`); ``strict``:
    raise RouterLogitsError instead of warning."""

    threshold: float | None = None
    strict: bool = os.environ.get(STRICT_ENV, "0").strip() not in ("", "0")

    def for_dtype(self, dtype: torch.dtype) -> float:
        if self.threshold is not None:
            return self.threshold
        return DEFAULT_THRESHOLDS.get(dtype, DEFAULT_THRESHOLD)


LIMITS = RouterLimits()


def set_router_limits(*, threshold: float | None = None, strict: bool | None = None) -> RouterLimits:
    """Set the logits' absmax above which a guarded router warns (every dtype; ``None`` leaves it)
    and whether it raises instead; returns the limits."""
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
            raise ValueError(f"cublas_guard_ext: a router threshold is a positive number, got {threshold!r}")
        LIMITS.threshold = float(threshold)
    if strict is not None:
        LIMITS.strict = bool(strict)
    return LIMITS


@dataclass
class _LogitsState:
    """One router's logit check: its calls so far, whether it warned, the async reads pending."""

    calls: int = 0
    warned: bool = False
    pending: list = field(default_factory=list)  # (stats on the host, event, dtype, tokens, call)


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
                out = _ops.linear(x, weight, bias, layer=self.label, mode=self.mode)
                _check_logits(self.router, self.label, self.mode, out)
                return out
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


def _one_hot(logits: torch.Tensor) -> torch.Tensor:
    """The fraction of tokens whose top-1 probability exceeds 0.99 (a 0-d tensor)."""
    z = logits.detach().reshape(-1, logits.shape[-1]).float()
    return (torch.softmax(z, dim=-1).amax(dim=-1) > 0.99).float().mean()


def _stats(logits: torch.Tensor) -> torch.Tensor:
    """[absmax, one-hot fraction] on the logits' device (the async read: both computed up front)."""
    with torch.no_grad():
        return torch.stack([logits.detach().abs().amax().float(), _one_hot(logits)])


def _verdict(
    router: nn.Module, label: str, host: list[float], dtype: torch.dtype, tokens: int, call: int
) -> None:
    """``host``: [absmax, one-hot fraction]; the fraction a callable where it is computed only on
    the warning's path (the direct read of the CPU and of sync mode)."""
    state = router.__dict__[LOGITS_ATTR]
    absmax, one_hot = host
    threshold = LIMITS.for_dtype(dtype)
    if state.warned or not (absmax > threshold or math.isnan(absmax)):
        return  # a NaN logit is refused by the guarded product before it gets here
    state.warned = True
    if callable(one_hot):
        one_hot = one_hot()
    fields = {
        "router": label,
        "dtype": str(dtype),
        "absmax": absmax,
        "threshold": threshold,
        "one_hot_fraction": one_hot,
        "tokens": tokens,
        "call": call,
    }
    if LIMITS.strict:
        raise RouterLogitsError(**fields)
    warnings.warn(RouterLogitsWarning(router_logits_message(fields)), stacklevel=_user_stacklevel())


# Under torch.compile the check is an op of the graph: traced, the router's forward records this
# op (marked side-effectful, so it is kept, in program order) and the compiled code calls it with
# the logits it computed; it runs the eager check below on them, warning or raising from the
# compiled call. The router is found by its id, entered when it is guarded (a weak table: a graph
# outliving its model, or its guard, checks nothing). Its dtype rule, threshold and async read are
# the eager ones.
_COMPILED_ROUTERS: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()


@torch.library.custom_op("cublas_guard_internal::router_logits_check", mutates_args=())
def _router_logits_in_graph(logits: torch.Tensor, router_id: int, label: str, mode: str) -> None:
    router = _COMPILED_ROUTERS.get(router_id)
    if router is not None and is_guarded_router(router):
        _check_logits(router, label, mode or None, logits)


@_router_logits_in_graph.register_fake
def _(logits: torch.Tensor, router_id: int, label: str, mode: str) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.cublas_guard_internal.router_logits_check.default)


def _check_logits(router: nn.Module, label: str, mode: str | None, logits: torch.Tensor) -> None:
    """Compare the logits' absmax with the threshold (see the module's docstring for when)."""
    if not logits.is_floating_point() or logits.dim() == 0:
        return
    if torch.compiler.is_compiling():
        torch.ops.cublas_guard_internal.router_logits_check(logits, id(router), label, mode or "")
        return
    effective = mode if mode is not None else _modes.current()
    state = router.__dict__.setdefault(LOGITS_ATTR, _LogitsState())
    state.calls += 1
    if effective == "off" or state.warned:
        return
    tokens = logits.numel() // max(logits.shape[-1], 1)
    if logits.device.type == "cpu" or effective == "sync":
        with torch.no_grad():  # one reduction and one read; the fraction only when it warns
            absmax = float(logits.detach().abs().amax()) if logits.numel() else 0.0
        _verdict(router, label, [absmax, lambda: float(_one_hot(logits))], logits.dtype, tokens, state.calls)
        return
    stats = _stats(logits)
    host = stats.to("cpu", non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    state.pending.append((host, event, logits.dtype, tokens, state.calls))


def _read_pending(router: nn.Module, label: str) -> None:
    """The async checks of earlier calls whose copies have landed (no host synchronization)."""
    state = router.__dict__.get(LOGITS_ATTR)
    if state is None or not state.pending:
        return
    ready = [event.query() for _, event, *_ in state.pending]
    landed = [p for p, r in zip(state.pending, ready, strict=True) if r]
    state.pending = [p for p, r in zip(state.pending, ready, strict=True) if not r]
    for host, _, dtype, tokens, call in landed:
        _verdict(router, label, host.tolist(), dtype, tokens, call)  # nothing once warned


def _pre(label: str, mode: str | None) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        _read_pending(module, label)
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
            _COMPILED_ROUTERS[id(module)] = module
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
            module.__dict__.pop(LOGITS_ATTR, None)
            _COMPILED_ROUTERS.pop(id(module), None)
