"""``SafeLinear``, a drop-in ``nn.Linear``, and the helpers that swap it in."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import modes
from . import ops as _ops_module
from .ops import DTYPE_POLICIES, validate_dtype_policy
from .ops import linear as _guarded_linear

__all__ = ["SafeLinear", "replace_linear", "name_layers"]


_UNNAMED_NUMBERS = itertools.count(1)
# The fast eager entry (see cublas_guard_ext.ops.fast_linear).
_fast_linear = _ops_module.fast_linear


def _reset_calls(name: str) -> None:
    torch.ops.cublas_guard_internal.reset_layer_calls.default(name)


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
        # Async reports count calls per label: unnamed layers get a label of their own,
        # and a layer taking a name restarts that name's count.
        self._unnamed_number = next(_UNNAMED_NUMBERS)
        if name:
            _reset_calls(name)

    # Attribute types for torch.jit.script (None-valued attributes stay Optional[str]: values
    # torch.jit reads at run time, kept in typing's spelling rather than str | None).
    __annotations__ = {
        **nn.Linear.__annotations__,
        "mode": Optional[str],  # noqa: UP045
        "guard_name": Optional[str],  # noqa: UP045
    }

    @property
    def guard_label(self) -> str:
        """What errors call this layer."""
        name = self.guard_name
        if name is not None and name != "":
            return name
        return (
            "<unnamed SafeLinear("
            + str(self.in_features)
            + "->"
            + str(self.out_features)
            + ") #"
            + str(self._unnamed_number)
            + ">"
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's name)
        if torch.jit.is_scripting():
            # TorchScript: the same native op (every check and scan, typed
            # errors); the layer's own mode, else "sync": guard() blocks and
            # CUBLAS_GUARD_MODE are Python state a scripted model cannot read.
            mode = self.mode
            # Literal codes (TorchScript takes no global ints): _native/codes.py's values,
            # checked by tests/test_codes.py.
            code = 1 if mode is None else (0 if mode == "off" else (2 if mode == "async" else 1))
            x = input
            cast = self.dtype_policy == "cast" and (
                input.dtype == torch.float16 or input.dtype == torch.bfloat16
            )
            if cast:
                x = input.float()
            out = torch.ops.cublas_guard.linear(
                x, self.weight, self.bias, self.guard_label, code, self.scan_grad
            )
            return out.to(input.dtype) if cast else out
        else:
            return self._eager_forward(input)

    @torch.jit.unused
    def _eager_forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        # The fast entry (see cublas_guard_ext.ops.fast_linear): the same op, the
        # same checks; None sends the call down ops.linear, which decides as before.
        # The parameters are read once: a parametrized weight (spectral_norm, weight_norm)
        # is computed at each read, and spectral_norm's power iteration moves its buffers
        # at each one in training, so a second read would make a different layer.
        weight, bias = self.weight, self.bias
        if self.dtype_policy == "strict":
            out = _fast_linear(input, weight, bias, self.guard_label, self.mode, self.scan_grad)
            if out is not None:
                return out
        return _guarded_linear(
            input,
            weight,
            bias,
            layer=self.guard_label,
            mode=self.mode,
            scan_grad=self.scan_grad,
            dtype_policy=self.dtype_policy,
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
        """A SafeLinear that takes over ``linear``'s state, sharing it (no copy, no re-init).

        Taken over: the Parameter objects (an optimizer built before the swap
        keeps updating the same tensors), buffers, submodules, the training
        flag, other attributes, and every hook (forward, forward-pre, backward,
        state_dict, load_state_dict: the same hook dicts, so the handles that
        registered them still remove them). Reparametrized Linears work too:
        the hook-based ``weight_norm``, ``spectral_norm`` and ``prune`` (their
        pre-hook recomputes ``weight`` before each forward) and
        ``torch.nn.utils.parametrize`` (the result is a ``ParametrizedSafeLinear``).
        Raises ``TypeError`` for a Linear whose ``forward`` was replaced by an
        instance attribute (accelerate-style wrapping): the wrapper calls the old
        module, so a swap would either drop it or leave the layer unguarded.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        reason = _why_not_swappable(linear)
        if reason is not None:
            raise TypeError(f"cublas_guard_ext: cannot swap this {type(linear).__name__}: {reason}")
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
        own = safe.__dict__
        for key, value in linear.__dict__.items():
            if key in _COPIED_STATE:  # a container of its own, holding the same objects
                own[key] = value.copy()
            elif key in _module_state_keys() or key not in own:
                own[key] = value  # hook dicts are shared on purpose (see above)
        if parametrize.is_parametrized(linear):
            parametrize._inject_new_class(safe)
            for tensor_name in linear.parametrizations:
                parametrize._inject_property(safe, tensor_name)
        return safe


# nn.Module's own containers that from_linear copies (the same objects in a new
# container); every other attribute of nn.Module/nn.Linear is taken as is.
_COPIED_STATE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
_MODULE_STATE_KEYS: frozenset[str] | None = None


def _module_state_keys() -> frozenset[str]:
    """The attributes every nn.Linear has (hook dicts, training, sizes)."""
    global _MODULE_STATE_KEYS
    if _MODULE_STATE_KEYS is None:
        _MODULE_STATE_KEYS = frozenset(nn.Linear(1, 1, device="meta").__dict__)
    return _MODULE_STATE_KEYS


def _swappable_type(module: nn.Module) -> bool:
    """nn.Linear itself, or the class torch.nn.utils.parametrize made of it."""
    cls = type(module)
    return cls is nn.Linear or (parametrize.is_parametrized(module) and cls.__bases__ == (nn.Linear,))


def _why_not_swappable(linear: nn.Linear) -> str | None:
    if "forward" in linear.__dict__:
        return (
            "its forward was replaced by an instance attribute (a wrapper such as accelerate's "
            "hooks); swapping would drop the wrapper, keeping it would bypass the guard"
        )
    return None


def _guard_transformer_layers(model: nn.Module) -> None:
    """Route Transformer layers holding a SafeLinear through their guarded slow path.

    In eval under no_grad, nn.TransformerEncoderLayer takes a fused fast path
    that reads linear1/linear2's weights without calling their forward, and
    nn.TransformerEncoder converts padded input to nested tensors for it: both
    would bypass the guard. ``activation_relu_or_gelu`` is read only to choose
    (and parametrize) the fast path, ``use_nested_tensor`` only to choose the
    nested conversion; the slow path computes the same function.
    """
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoderLayer) and any(
            isinstance(m, SafeLinear) for m in (module.linear1, module.linear2)
        ):
            module.activation_relu_or_gelu = 0
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder) and any(
            isinstance(m, SafeLinear) for m in module.modules()
        ):
            module.use_nested_tensor = False


def _after_optimizer_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    # Fused optimizers write parameters without bumping their version counters:
    # after any torch.optim step, no parameter is known clean any more.
    torch.ops.cublas_guard_internal.parameters_changed.default()


_OPTIMIZER_HOOK = register_optimizer_step_post_hook(torch.compiler.disable(_after_optimizer_step))


def name_layers(model: nn.Module, prefix: str = "") -> nn.Module:
    """Give every SafeLinear in ``model`` its qualified name (``encoder.0.fc1``).

    A module registered under several names gets the first. Names set by hand
    (``SafeLinear(name=...)``, ``guard_name = ...``) are kept; names this
    function gave earlier are updated.
    """
    for name, module in model.named_modules(prefix=prefix):
        if isinstance(module, SafeLinear) and (
            module.guard_name is None or module.guard_name == module.__dict__.get("_auto_guard_name")
        ):
            _set_auto_name(module, name or type(model).__name__)
    _guard_transformer_layers(model)
    return model


def _set_auto_name(module: SafeLinear, name: str) -> None:
    if module.guard_name != name:
        _reset_calls(name)
    module.guard_name = name
    module._auto_guard_name = name


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


def replace_linear(
    model: nn.Module,
    which: str | Iterable[str] = "all",
    *,
    mode: str | None = None,
    scan_grad: bool = False,
    dtype_policy: str = "strict",
    example_inputs: tuple | torch.Tensor | None = None,
) -> nn.Module:
    """Swap ``nn.Linear`` modules for ``SafeLinear`` in place; return the model.

    ``which``: ``"all"``, ``"first"``, or qualified names. ``"first"`` means the
    first one a forward pass calls when ``example_inputs`` is given (a tensor
    or a tuple of positional arguments; run in eval mode under no_grad, leaving
    the model as it was), else the first registered (usually, not always, the
    first called). A Linear registered under several names (``Sequential(lin,
    ReLU(), lin)``) is one module: it is swapped in every slot by the same
    SafeLinear, and any of its names selects it. Swapped: exact ``nn.Linear``
    instances, also reparametrized ones (weight_norm, spectral_norm, prune,
    torch.nn.utils.parametrize); hooks and attributes are taken over (see
    :meth:`SafeLinear.from_linear`). Subclasses (e.g. the out_proj of
    ``nn.MultiheadAttention``, whose weight is used without calling forward)
    keep their type. Transformer encoder layers holding a swapped Linear are
    routed through their guarded slow path (see docs/guarantees.md). Parameters are
    shared, not copied. Everything is checked and built before the first swap:
    an error leaves the model untouched. If ``model`` itself is an
    ``nn.Linear``, the new SafeLinear is returned.
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
    if isinstance(model, nn.Linear) and _swappable_type(model):
        safe = SafeLinear.from_linear(model, **options)
        _set_auto_name(safe, type(model).__name__)
        return safe

    # Every slot of every swappable Linear, by module (a module may have several names).
    modules: list[nn.Module] = []
    slots: list[list[str]] = []
    position: dict[int, int] = {}
    for qualified, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, nn.Linear) and _swappable_type(module):
            if id(module) not in position:
                position[id(module)] = len(modules)
                modules.append(module)
                slots.append([])
            slots[position[id(module)]].append(qualified)
    by_name = {name: i for i, names in enumerate(slots) for name in names}

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
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ValueError(f"not nn.Linear modules of this model: {unknown}")
        chosen = list(dict.fromkeys(by_name[n] for n in names))

    # Plan: refuse or skip what cannot be swapped, build every SafeLinear; then swap.
    built: list[tuple[int, SafeLinear]] = []
    for i in chosen:
        reason = _why_not_swappable(modules[i])
        if reason is not None:
            if explicit:
                raise TypeError(f"cublas_guard_ext: cannot swap {slots[i][0]!r}: {reason}")
            warnings.warn(
                f"cublas_guard_ext: {slots[i][0]!r} stays an unguarded nn.Linear: {reason}",
                stacklevel=2,
            )
            continue
        built.append((i, SafeLinear.from_linear(modules[i], **options)))
    for i, safe in built:
        for qualified in slots[i]:
            parent_name, _, child = qualified.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, safe)
    return name_layers(model)
