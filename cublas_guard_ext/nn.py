"""``SafeLinear``, a drop-in ``nn.Linear``, and the helpers that swap it in."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from . import modes
from .ops import linear as _guarded_linear
from .ops import validate_dtype_policy

__all__ = ["SafeLinear", "replace_linear", "name_layers"]


class SafeLinear(nn.Linear):
    """``nn.Linear`` whose forward runs through the guard.

    Same constructor, parameters, initialisation, ``state_dict`` keys and
    ``repr`` as ``nn.Linear`` (it is a subclass, so ``isinstance(m, nn.Linear)``
    still holds). Extra keyword-only arguments:

    * ``mode``: ``"sync"``, ``"async"`` or ``"off"``; None follows the default
      (see :mod:`cublas_guard_ext.modes`).
    * ``name``: the name errors use; :func:`replace_linear` and
      :func:`name_layers` set it to the module's qualified name.
    * ``scan_grad``: also scan the gradient arriving at this layer in backward
      (exploding or NaN gradients), under the layer's mode.
    * ``dtype_policy``: ``"strict"`` (default: nn.Linear's dtype rules; float32,
      bfloat16, float16 and float64 all run natively) or the deprecated
      ``"cast"`` (see :data:`cublas_guard_ext.ops.DTYPE_POLICIES`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        mode: str | None = None,
        name: str | None = None,
        scan_grad: bool = False,
        dtype_policy: str = "strict",
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        validate_dtype_policy(dtype_policy)
        self.mode = modes.validate(mode) if mode is not None else None
        self.guard_name = name
        self.scan_grad = bool(scan_grad)
        self.dtype_policy = dtype_policy

    @property
    def guard_label(self) -> str:
        """What errors call this layer."""
        if self.guard_name:
            return self.guard_name
        return f"<unnamed SafeLinear({self.in_features}->{self.out_features})>"

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's name)
        return _guarded_linear(
            input, self.weight, self.bias, layer=self.guard_label, mode=self.mode,
            scan_grad=self.scan_grad, dtype_policy=self.dtype_policy,
        )

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.mode is not None:
            text += f", mode={self.mode!r}"
        text += ", scan_grad=True" if self.scan_grad else ""
        return text + (f", dtype_policy={self.dtype_policy!r}" if self.dtype_policy != "strict" else "")

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        mode: str | None = None,
        name: str | None = None,
        scan_grad: bool = False,
        dtype_policy: str = "strict",
    ) -> SafeLinear:
        """A SafeLinear sharing ``linear``'s Parameter objects (no copy, no re-init).

        Sharing keeps an optimizer built before the swap updating the same
        tensors. Hooks registered on ``linear`` are not carried over.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        safe = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",  # no allocation and no init: the parameters come from `linear`
            mode=mode,
            name=name,
            scan_grad=scan_grad,
            dtype_policy=dtype_policy,
        )
        safe.weight = linear.weight
        if linear.bias is not None:
            safe.bias = linear.bias
        safe.train(linear.training)
        return safe


def name_layers(model: nn.Module, prefix: str = "") -> nn.Module:
    """Give every SafeLinear in ``model`` its qualified name (``encoder.0.fc1``)."""
    for name, module in model.named_modules(prefix=prefix):
        if isinstance(module, SafeLinear):
            module.guard_name = name or type(model).__name__
    return model


def _first_called(model: nn.Module, candidates: list[str], example_inputs: tuple) -> str | None:
    """The first of ``candidates`` that a forward pass on ``example_inputs`` calls."""
    modules = dict(model.named_modules())
    order: list[str] = []
    handles = [
        modules[name].register_forward_pre_hook(lambda _m, _a, n=name: order.append(n))
        for name in candidates
    ]
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for handle in handles:
            handle.remove()
    return order[0] if order else None


def replace_linear(
    model: nn.Module,
    which: str | Iterable[str] = "all",
    *,
    mode: str | None = None,
    scan_grad: bool = False,
    dtype_policy: str = "strict",
    example_inputs: tuple | None = None,
) -> nn.Module:
    """Swap ``nn.Linear`` modules for ``SafeLinear`` in place; return the model.

    ``which``: ``"all"``, ``"first"``, or qualified names. ``"first"`` means the
    first one a forward pass calls when ``example_inputs`` is given, else the
    first registered (usually, not always, the first called). Only exact
    ``nn.Linear`` instances are swapped: subclasses (e.g. the out_proj of
    ``nn.MultiheadAttention``, whose weight is used without calling forward)
    keep their type. Parameters are shared, not copied. If ``model`` itself is
    an ``nn.Linear``, the new SafeLinear is returned.
    """
    if mode is not None:
        modes.validate(mode)
    if type(model) is nn.Linear:
        return SafeLinear.from_linear(
            model, mode=mode, name=type(model).__name__, scan_grad=scan_grad,
            dtype_policy=dtype_policy,
        )
    linears = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    if isinstance(which, str):
        if which == "all":
            chosen = linears
        elif which == "first":
            if not linears:
                chosen = []
            elif example_inputs is not None:
                first = _first_called(model, linears, tuple(example_inputs))
                chosen = [first] if first is not None else []
            else:
                chosen = linears[:1]
        else:
            raise ValueError(f"which must be 'all', 'first' or a list of names, got {which!r}")
    else:
        chosen = list(which)
        unknown = [n for n in chosen if n not in linears]
        if unknown:
            raise ValueError(f"not nn.Linear modules of this model: {unknown}")
    for qualified in chosen:
        parent_name, _, child = qualified.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        setattr(
            parent,
            child,
            SafeLinear.from_linear(
                old, mode=mode, name=qualified, scan_grad=scan_grad, dtype_policy=dtype_policy
            ),
        )
    return name_layers(model)
