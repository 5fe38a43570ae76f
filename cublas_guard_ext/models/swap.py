"""Swapping the guarded layers into a model and back, and what a model leaves unguarded.

* :func:`replace_linear`: ``nn.Linear`` -> ``SafeLinear`` and transformers' ``Conv1D`` ->
  ``SafeConv1D``, in place; logs (logger ``cublas_guard_ext``, INFO) what it swapped and
  what it left, and warns once when it left a matmul unguarded.
* :func:`restore_linear`: the way back, the same Parameter objects in plain modules (for
  ONNX export, ``quantize_dynamic``, or a model saved whole without this package).
* :func:`coverage`: which matmul-bearing modules of a model are guarded, and why the
  others are not.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from .. import fp8
from ..errors.experts import experts_left_reason, experts_other_reason, fused_3d_reason
from ..guarded_linear import modes
from ..guarded_linear.nn import (
    FAST_PATH_ORIGINALS,
    GUARD_ATTRIBUTES,
    SafeConv1D,
    SafeLinear,
    _set_auto_name,
    _swappable_type,
    _why_not_swappable,
    is_conv1d,
    is_guarded,
    name_layers,
    retyped,
)
from ..guarded_linear.ops import DTYPE_POLICIES
from . import experts, routers

__all__ = ["replace_linear", "restore_linear", "coverage", "Coverage"]

_log = logging.getLogger("cublas_guard_ext")


# -- what a model leaves unguarded ------------------------------------------------------------
@dataclass
class Coverage:
    """Which matmul-bearing modules of a model are guarded: ``guarded`` (qualified names),
    ``left`` ((name, type name, reason) of each one that is not). ``str()`` is the summary."""

    guarded: list[str] = field(default_factory=list)
    left: list[tuple[str, str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"cublas_guard_ext: {len(self.guarded)} layers guarded, {len(self.left)} left unguarded"]
        lines += [f"  left {name or '<model>'} ({kind}): {reason}" for name, kind, reason in self.left]
        return "\n".join(lines)


# Modules that hold a 2-D or larger weight and are not matmuls of this kind.
_NOT_MATMULS = (
    nn.Embedding,
    nn.EmbeddingBag,
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
)


# Parameters of 2 or more dims that are added or looked up, not multiplied: ViT's pos_embed
# and cls_token, Swin's relative_position_bias_table, learned scales.
_NOT_WEIGHT_WORDS = ("embed", "pos", "token", "bias", "table", "scale", "norm")


def _is_guarded_any(module: nn.Module) -> bool:
    """A guarded Linear, experts, Float8Linear or router: its matmuls are guarded."""
    return (
        is_guarded(module)
        or experts.is_guarded_experts(module)
        or fp8.is_guarded_float8(module)
        or routers.is_guarded_router(module)
    )


def _reason_left(module: nn.Module, conv1d: bool) -> str | None:
    """Why this module's matmul is not guarded (None: guarded, or it holds none)."""
    if _is_guarded_any(module):
        return None
    kind = type(module).__name__
    if experts.is_hf_experts(module):
        implementation = experts.implementation_of(module)
        if implementation in experts.GUARDABLE:
            return experts_left_reason(implementation)
        return experts_other_reason(implementation)
    if isinstance(module, nn.MultiheadAttention):
        return (
            "MultiheadAttention multiplies its packed in_proj_weight inside "
            "F.multi_head_attention_forward (no Linear call to guard); its out_proj is a "
            "Linear subclass read the same way"
        )
    if isinstance(module, nn.Linear):
        float8 = fp8.float8_left_reason(module)  # torchao's Float8Linear: fp8/
        if float8 is not None:
            return float8
        if not _swappable_type(module):
            return (
                f"a subclass of nn.Linear ({kind}): its forward or its weight's use may differ from "
                "nn.Linear's (MultiheadAttention's out_proj is read without calling forward), so "
                "it keeps its type"
            )
        return _why_not_swappable(module) or (
            "a plain nn.Linear: not selected by replace_linear's which=, or added after it ran "
            "(cublas_guard_ext.replace_linear(model) again guards it)"
        )
    if is_conv1d(module):
        return _why_not_swappable(module) or (
            "transformers Conv1D, not swapped (replace_linear(conv1d=False))"
            if not conv1d
            else "a plain Conv1D: not selected by replace_linear's which=, or added after it ran "
            "(cublas_guard_ext.replace_linear(model) again guards it)"
        )
    if isinstance(module, _NOT_MATMULS):
        return None
    own = [
        (n, p)
        for n, p in module._parameters.items()
        if p is not None and p.dim() >= 2 and not any(word in n.lower() for word in _NOT_WEIGHT_WORDS)
    ]
    if not own:
        return None
    shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in own)
    if any(p.dim() >= 3 for _, p in own):
        return fused_3d_reason(shapes)
    return (
        f"a 2-D weight ({shapes}) multiplied in its own forward (a router or gate calling "
        "F.linear/matmul itself), not through a Linear"
    )


def coverage(model: nn.Module, *, conv1d: bool = True) -> Coverage:
    """What in ``model`` is guarded and what is not, with the reason (fused 3-D expert
    weights, MultiheadAttention's packed projection, a Linear subclass, a forward replaced
    by a wrapper, not selected). A module registered under several names counts once."""
    out = Coverage()
    seen: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        if _is_guarded_any(module):
            out.guarded.append(name)
            continue
        reason = _reason_left(module, conv1d)
        if reason is not None:
            out.left.append((name, type(module).__name__, reason))
    return out


# -- swapping in -------------------------------------------------------------------------------
def _first_called(model: nn.Module, candidates: list[nn.Module], example_inputs: tuple) -> int | None:
    """The index of the first of ``candidates`` that a forward on ``example_inputs`` calls.

    The forward runs in eval mode under no_grad, and every training flag and
    buffer is restored afterwards: it leaves no trace (BatchNorm statistics,
    spectral_norm's vectors).
    """
    order: list[int] = []
    handles = [
        module.register_forward_pre_hook(lambda _m, _a, i=i: order.append(i))
        for i, module in enumerate(candidates)
    ]
    flags = [(m, m.training) for m in model.modules()]
    with torch.no_grad():
        buffers = [(b, b.clone()) for b in model.buffers()]
    try:
        model.eval()
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for handle in handles:
            handle.remove()
        for module, training in flags:
            module.training = training
        with torch.no_grad():
            for buffer, saved in buffers:
                if not torch.equal(buffer, saved):
                    buffer.copy_(saved)
    return order[0] if order else None


def _swappable(module: nn.Module, conv1d: bool) -> bool:
    return (isinstance(module, nn.Linear) and _swappable_type(module)) or (conv1d and is_conv1d(module))


def _guarded_twin(module: nn.Module, options: dict[str, Any]) -> nn.Module:
    if is_conv1d(module):
        return SafeConv1D.from_conv1d(module, **options)
    return SafeLinear.from_linear(module, **options)


def _why_not(module: nn.Module) -> str | None:
    return _why_not_swappable(module)  # the same rule for a Linear and a Conv1D


def replace_linear(
    model: nn.Module,
    which: str | Iterable[str] = "all",
    *,
    mode: str | None = None,
    scan_grad: bool = False,
    dtype_policy: str = "strict",
    example_inputs: tuple | torch.Tensor | None = None,
    conv1d: bool = True,
) -> nn.Module:
    """Swap ``nn.Linear`` modules for ``SafeLinear`` (and transformers' ``Conv1D`` for
    ``SafeConv1D``) in place; return the model.

    ``which``: ``"all"``, ``"first"``, or qualified names. ``"first"`` means the
    first one a forward pass calls when ``example_inputs`` is given (a tensor
    or a tuple of positional arguments; run in eval mode under no_grad, leaving
    the model as it was), else the first registered (usually, not always, the
    first called). A Linear registered under several names (``Sequential(lin,
    ReLU(), lin)``) is one module: it is swapped in every slot by the same
    SafeLinear, and any of its names selects it. Swapped: exact ``nn.Linear``
    instances, also reparametrized ones (weight_norm, spectral_norm, prune,
    torch.nn.utils.parametrize); hooks and attributes are taken over (see
    :meth:`SafeLinear.from_linear`); and, unless ``conv1d=False``, exact
    ``transformers.pytorch_utils.Conv1D`` modules (GPT-2's attention and MLP
    projections). Subclasses (e.g. the out_proj of ``nn.MultiheadAttention``, whose
    weight is used without calling forward) keep their type. Transformer encoder layers
    holding a swapped Linear are routed through their guarded slow path (see
    docs/guarantees.md). Parameters are shared, not copied. Everything is checked and
    built before the first swap: an error leaves the model untouched. If ``model`` itself
    is an ``nn.Linear`` (or a Conv1D), the guarded layer is returned.

    transformers' mixture-of-experts experts modules (3-D expert weights run by the experts
    interface: Mixtral, Qwen-MoE, gpt-oss, ...) get the guarded ``"cublas_guard"`` experts
    implementation (:mod:`cublas_guard_ext.models.experts`) with ``which="all"`` or when named in
    ``which``; the router is untouched. The implementation is chosen per config, as
    transformers chooses it: the experts modules sharing a config are guarded together.

    What was swapped and what was left (with the reason: fused 3-D expert weights,
    MultiheadAttention's packed projection, a Linear subclass, ...) is logged at INFO on the
    ``cublas_guard_ext`` logger, and a ``UserWarning`` names what was left unguarded;
    :func:`coverage` gives the same summary as an object at any time (after
    ``resize_token_embeddings`` made a new plain ``lm_head``, for instance).
    """
    if mode is not None:
        modes.validate(mode)
    if dtype_policy not in DTYPE_POLICIES:
        raise ValueError(f"dtype_policy must be one of {DTYPE_POLICIES}, got {dtype_policy!r}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    elif example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        raise TypeError(
            "cublas_guard_ext: example_inputs must be a tensor or a tuple of the model's positional "
            f"arguments, got {type(example_inputs).__name__}"
        )
    options = {"mode": mode, "scan_grad": scan_grad, "dtype_policy": dtype_policy}
    if _swappable(model, conv1d):
        safe = _guarded_twin(model, options)
        _set_auto_name(safe, type(model).__name__)
        return safe
    if fp8.float8_left_reason(model) is not None:  # the model is one torchao Float8Linear
        fp8.guard_float8(model, None, mode)
        return model

    # Every slot of every swappable module, by module (a module may have several names).
    modules: list[nn.Module] = []
    slots: list[list[str]] = []
    position: dict[int, int] = {}
    for qualified, module in model.named_modules(remove_duplicate=False):
        if _swappable(module, conv1d):
            if id(module) not in position:
                position[id(module)] = len(modules)
                modules.append(module)
                slots.append([])
            slots[position[id(module)]].append(qualified)
    by_name = {name: i for i, names in enumerate(slots) for name in names}
    experts_names = {name for name, module in model.named_modules() if experts.is_hf_experts(module)}
    # torchao's Float8Linear layers: guarded in place, FP8 kept (fp8/linear.py)
    float8_names = {name for name, module in model.named_modules() if fp8.float8_left_reason(module)}

    explicit = not isinstance(which, str)
    if isinstance(which, str):
        if which == "all":
            chosen = list(range(len(modules)))
        elif which == "first":
            if not modules:
                chosen = []
            elif example_inputs is not None:
                first = _first_called(model, modules, tuple(example_inputs))
                chosen = [first] if first is not None else []
            else:
                chosen = [0]
        else:
            raise ValueError(f"which must be 'all', 'first' or a list of names, got {which!r}")
    else:
        names = list(which)
        unknown = [n for n in names if n not in by_name and n not in experts_names and n not in float8_names]
        if unknown:
            also = " (nor transformers Conv1D)" if conv1d else ""
            raise ValueError(f"not nn.Linear modules of this model{also}: {unknown}")
        chosen = list(dict.fromkeys(by_name[n] for n in names if n in by_name))

    # Plan: refuse or skip what cannot be swapped, build every guarded layer; then swap.
    built: list[tuple[int, nn.Module]] = []
    for i in chosen:
        reason = _why_not(modules[i])
        if reason is not None:
            if explicit:
                raise TypeError(f"cublas_guard_ext: cannot swap {slots[i][0]!r}: {reason}")
            continue  # reported below with everything else left
        built.append((i, _guarded_twin(modules[i], options)))
    for i, safe in built:
        for qualified in slots[i]:
            _set_child(model, qualified, safe)
            _remember_slot(model, qualified, options)
    name_layers(model)
    if which == "all" or (explicit and experts_names.intersection(names)):
        experts.guard_experts(model, None if which == "all" else set(names), mode)
    if which == "all" or (explicit and float8_names.intersection(names)):
        fp8.guard_float8(model, None if which == "all" else set(names), mode)
    if which == "all":
        routers.guard_routers(model, mode)  # models/routers.py: the routers' own F.linear
    _report(model, conv1d, explicit or which == "first")
    return model


# A parent's slots that replace_linear guarded, with the options: a plain Linear/Conv1D
# assigned there later (resize_token_embeddings' new lm_head) is guarded in turn.
GUARDED_SLOTS = "_cublas_guard_slots"


def _remember_slot(model: nn.Module, qualified: str, options: dict[str, Any]) -> None:
    parent_name, _, child = qualified.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent.__dict__.setdefault(GUARDED_SLOTS, {})[child] = dict(options)


def _guard_new_module_in_guarded_slot(parent: nn.Module, name: str, module: Any) -> Any:
    """torch's module-registration hook: a plain nn.Linear or Conv1D registered where
    replace_linear put a guarded layer gets guarded too (the same options, and the old layer's
    name). Every other registration returns None (unchanged) after one dict lookup."""
    slots = parent.__dict__.get(GUARDED_SLOTS)
    if not slots or name not in slots or not _swappable(module, True) or _why_not(module) is not None:
        return None
    safe = _guarded_twin(module, slots[name])
    old = parent._modules.get(name)
    if is_guarded(old) and old.guard_name == old.__dict__.get("_auto_guard_name") and old.guard_name:
        _set_auto_name(safe, old.guard_name)
    return safe


_REGISTRATION_HOOK = torch.nn.modules.module.register_module_module_registration_hook(
    _guard_new_module_in_guarded_slot
)


def _set_child(model: nn.Module, qualified: str, module: nn.Module) -> None:
    parent_name, _, child = qualified.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _report(model: nn.Module, conv1d: bool, selective: bool) -> None:
    """Log the summary; warn about matmuls left unguarded (not the ones the caller chose to
    leave with which=)."""
    summary = coverage(model, conv1d=conv1d)
    _log.info("%s", summary)
    left = [
        (name, kind, reason)
        for name, kind, reason in summary.left
        if not (selective and reason.startswith("a plain"))
        and not (not conv1d and kind == "Conv1D" and "conv1d=False" in reason)
    ]
    if left:
        shown = "; ".join(f"{name or '<model>'} ({kind}): {reason}" for name, kind, reason in left[:4])
        more = f"; and {len(left) - 4} more" if len(left) > 4 else ""
        warnings.warn(
            f"cublas_guard_ext.replace_linear guarded {len(summary.guarded)} layers and left "
            f"{len(left)} matmul-bearing modules unguarded: {shown}{more} "
            "(cublas_guard_ext.coverage(model) lists them)",
            UserWarning,
            stacklevel=3,
        )


# -- swapping back ----------------------------------------------------------------------------
def restore_linear(model: nn.Module) -> nn.Module:
    """Every SafeLinear back to ``nn.Linear`` and every SafeConv1D back to transformers'
    ``Conv1D``, in place; return the model (or, if ``model`` itself is guarded, the plain twin).

    The same Parameter objects, buffers, hooks and attributes (an optimizer built before keeps
    stepping them; ``state_dict`` keys are unchanged), reparametrizations kept
    (``ParametrizedSafeLinear`` -> ``ParametrizedLinear``); Transformer encoder layers get
    their fused fast path back. For what needs plain modules: ``torch.onnx.export`` of a model
    without the guard, ``torch.ao.quantization.quantize_dynamic`` (which only converts exact
    ``nn.Linear`` types), or pickling a whole model for a machine without this package.
    transformers experts modules get back the experts implementation they had before
    :func:`replace_linear` (``grouped_mm``, ``eager``, ...).
    """
    if is_guarded(model):
        return _plain_twin(model)
    fp8.restore_float8(model)  # guarded Float8Linear layers: back to torchao's, in place
    twins: dict[int, nn.Module] = {}
    slots = [
        (qualified, module)
        for qualified, module in model.named_modules(remove_duplicate=False)
        if qualified and is_guarded(module)
    ]
    for module in model.modules():  # first: assigning the plain twins must not guard them again
        module.__dict__.pop(GUARDED_SLOTS, None)
    for qualified, module in slots:
        twin = twins.setdefault(id(module), _plain_twin(module))
        _set_child(model, qualified, twin)
    for module in model.modules():
        originals = module.__dict__.pop(FAST_PATH_ORIGINALS, None)
        if originals:
            for attr, value in originals.items():
                setattr(module, attr, value)
    experts.restore_experts(model)
    routers.restore_routers(model)
    return model


def _plain_twin(module: nn.Module) -> nn.Module:
    if isinstance(module, SafeLinear):
        parametrized = parametrize.is_parametrized(module)
        plain = retyped(module, nn.Linear, drop=GUARD_ATTRIBUTES)
        if parametrized:
            parametrize._inject_new_class(plain)
            for tensor_name in module.parametrizations:
                parametrize._inject_property(plain, tensor_name)
        return plain
    from transformers.pytorch_utils import Conv1D  # a SafeConv1D exists: transformers is imported

    return retyped(module, Conv1D, drop=GUARD_ATTRIBUTES)
