"""``SafeLinear``, a drop-in ``nn.Linear``; ``SafeConv1D``, the same for transformers'
``Conv1D`` (GPT-2's projections); and naming them. Swapping them into a model and back:
:mod:`cublas_guard_ext.swap`."""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import modes
from . import naming as _naming
from . import ops as _ops_module
from .ao_quantization import QCONFIG as _QCONFIG
from .error_hooks import LAST_RAN as _ran
from .naming import remember as _remember_parents
from .naming import strip_wrappers
from .ops import linear as _guarded_linear
from .ops import validate_dtype_policy

__all__ = ["SafeLinear", "SafeConv1D", "name_layers", "GUARD_ATTRIBUTES"]

# The attributes a guarded layer adds to the module it replaces (restore_linear drops them).
GUARD_ATTRIBUTES = ("mode", "guard_name", "scan_grad", "dtype_policy", "_unnamed_number", "_auto_guard_name")


_UNNAMED_NUMBERS = itertools.count(1)
# The fast eager entry (see cublas_guard_ext.ops.fast_linear).
_fast_linear = _ops_module.fast_linear


def _reset_calls(name: str) -> None:
    torch.ops.cublas_guard_internal.reset_layer_calls.default(name)


class SafeLinear(nn.Linear):
    """``nn.Linear`` whose forward runs through the guard.

    Same constructor, parameters, initialisation and ``state_dict`` keys as
    ``nn.Linear`` (it is a subclass, so ``isinstance(m, nn.Linear)`` still holds);
    its ``repr`` is nn.Linear's under its own class name, plus the options that
    differ from the defaults: ``SafeLinear(in_features=8, out_features=16,
    bias=True, mode='async')``. Extra keyword-only arguments:

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

    # torch.ao's quantization passes set a qconfig on every module, then swap only exact
    # nn.Linear types: a guarded layer they set one on earns one warning naming the way out.
    qconfig = _QCONFIG
    __jit_unused_properties__ = ["qconfig"]

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
            # Literal codes (TorchScript takes no global ints): _native/loading/codes.py's values,
            # checked by tests/package/test_codes.py.
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
        # same checks; None sends the call down ops.linear, which decides the
        # same way through torch.ops.
        # The parameters are read once: a parametrized weight (spectral_norm, weight_norm)
        # is computed at each read, and spectral_norm's power iteration moves its buffers
        # at each one in training, so a second read would make a different layer.
        # An error names the layer where it sits now (naming.py, when the error is built); a
        # refused half-precision input names the guarded layer that ran before it (_ran).
        weight, bias, label = self.weight, self.bias, self.guard_label
        if self.dtype_policy == "strict":
            out = _fast_linear(input, weight, bias, label, self.mode, self.scan_grad)
            if out is not None:
                _ran.label = label
                return out
        out = _guarded_linear(
            input,
            weight,
            bias,
            layer=label,
            mode=self.mode,
            scan_grad=self.scan_grad,
            dtype_policy=self.dtype_policy,
        )
        _ran.label = label
        return out

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
            _set_keeping_original(module, "activation_relu_or_gelu", 0)
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder) and any(
            isinstance(m, SafeLinear) for m in module.modules()
        ):
            _set_keeping_original(module, "use_nested_tensor", False)


# Where _guard_transformer_layers keeps the values it changed (restore_linear puts them back).
FAST_PATH_ORIGINALS = "_cublas_guard_fast_path_originals"


def _set_keeping_original(module: nn.Module, attr: str, value: Any) -> None:
    originals = module.__dict__.setdefault(FAST_PATH_ORIGINALS, {})
    originals.setdefault(attr, getattr(module, attr))
    setattr(module, attr, value)


def _after_optimizer_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    # Fused optimizers write parameters without bumping their version counters:
    # after any torch.optim step, no parameter is known clean any more.
    if torch.compiler.is_compiling():
        # a compiled optimizer step: an op the graph keeps and runs at every step (the native
        # op takes no tensor, so the tracer would run it once while tracing and record nothing)
        _parameters_changed_in_graph(torch.empty(0))
    else:
        torch.ops.cublas_guard_internal.parameters_changed.default()


@torch.library.custom_op("cublas_guard_internal::parameters_changed_in_graph", mutates_args=())
def _parameters_changed_in_graph(token: torch.Tensor) -> None:
    torch.ops.cublas_guard_internal.parameters_changed.default()


@_parameters_changed_in_graph.register_fake
def _(token: torch.Tensor) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.cublas_guard_internal.parameters_changed_in_graph.default)
# (Not torch.compiler.disable: that imports torch._dynamo, over a second at every import.)
_OPTIMIZER_HOOK = register_optimizer_step_post_hook(_after_optimizer_step)


def name_layers(model: nn.Module, prefix: str = "") -> nn.Module:
    """Give every SafeLinear in ``model`` its qualified name (``encoder.0.fc1``).

    A module registered under several names gets the first. Names set by hand
    (``SafeLinear(name=...)``, ``guard_name = ...``) are kept; names this
    function gave earlier are updated. Wrappers are looked through: a compiled,
    DDP or FSDP model's layers get the names they have in the model inside
    (``fc1``, not ``_orig_mod.fc1`` or ``module.fc1``). An error renames the layers
    again when the model changed since (:mod:`cublas_guard_ext.guarded_linear.naming`).
    """
    for name, module in model.named_modules():
        if is_guarded(module) and (
            module.guard_name is None or module.guard_name == module.__dict__.get("_auto_guard_name")
        ):
            name = ".".join(p for p in (prefix, strip_wrappers(model, name)) if p)
            _set_auto_name(module, name or type(model).__name__)
    _remember_parents(model, prefix)
    _guard_transformer_layers(model)
    return model


_naming.use_name_layers(name_layers)


def _set_auto_name(module: nn.Module, name: str) -> None:
    if module.guard_name != name:
        _reset_calls(name)
    module.guard_name = name
    module._auto_guard_name = name


class SafeConv1D(nn.Module):
    """transformers' ``Conv1D`` (GPT-2's attention and MLP projections: ``y = x W + b`` with
    ``W`` stored ``[in, out]``, a Linear with a transposed weight) through the guard.

    Made by :func:`cublas_guard_ext.replace_linear` from a model's ``Conv1D`` modules with
    :meth:`from_conv1d`; its class is made on first use as a subclass of transformers'
    ``Conv1D`` (``isinstance(m, Conv1D)`` still holds, so PEFT and transformers' pruning treat
    it as one). The forward is the guarded linear of ``x`` with ``W.t()`` (a view, no copy):
    the same checks, scans and typed errors as SafeLinear's, and on the CPU bitwise the
    output of Conv1D's ``addmm`` (tests/linear/test_replace_linear.py). Parameters, ``state_dict``
    keys and hooks are Conv1D's own (shared with the module it replaced). Options: ``mode``,
    ``guard_name``, ``scan_grad``, ``dtype_policy`` as SafeLinear's.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # SafeConv1D(nf, nx, ...): an instance of the class built on transformers' Conv1D
        # (Python then runs that class's __init__)
        return super().__new__(_conv1d_class() if cls is SafeConv1D else cls)

    @classmethod
    def from_conv1d(
        cls,
        conv: nn.Module,
        *,
        mode: str | None = None,
        name: str | None = None,
        scan_grad: bool = False,
        dtype_policy: str = "strict",
    ) -> nn.Module:
        """A guarded Conv1D taking over ``conv``'s state, sharing it (no copy, no re-init): the
        Parameter objects, buffers, hooks and attributes, as :meth:`SafeLinear.from_linear`."""
        if not is_conv1d(conv):
            raise TypeError(f"from_conv1d expects a transformers Conv1D, got {type(conv).__name__}")
        if "forward" in conv.__dict__:
            raise TypeError(
                "cublas_guard_ext: cannot swap this Conv1D: its forward was replaced by an instance "
                "attribute (a wrapper such as accelerate's hooks)"
            )
        options = _checked_options(mode, name, scan_grad, dtype_policy)
        safe = retyped(conv, _conv1d_class())
        safe.__dict__.update(options)
        return safe


def _checked_options(
    mode: str | None, name: str | None, scan_grad: bool, dtype_policy: str
) -> dict[str, Any]:
    """A guarded layer's own attributes (GUARD_ATTRIBUTES), checked."""
    validate_dtype_policy(dtype_policy, stacklevel=4)
    if name:
        _reset_calls(name)
    return {
        "mode": modes.validate(mode) if mode is not None else None,
        "guard_name": name,
        "scan_grad": bool(scan_grad),
        "dtype_policy": dtype_policy,
        "_unnamed_number": next(_UNNAMED_NUMBERS),
    }


class _GuardedConv1D:
    """The guarded forward of SafeConv1D (mixed in before transformers' Conv1D)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    nf: int
    nx: int

    @property
    def guard_label(self) -> str:
        name = self.guard_name
        if name is not None and name != "":
            return name
        return f"<unnamed SafeConv1D({self.nx}->{self.nf}) #{self._unnamed_number}>"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t()  # [out, in], a view: the guarded linear takes strided weights
        label = self.guard_label
        if self.dtype_policy == "strict":
            out = _fast_linear(x, weight, self.bias, label, self.mode, self.scan_grad)
            if out is not None:
                _ran.label = label
                return out
        out = _guarded_linear(
            x,
            weight,
            self.bias,
            layer=label,
            mode=self.mode,
            scan_grad=self.scan_grad,
            dtype_policy=self.dtype_policy,
        )
        _ran.label = label
        return out

    def __repr__(self) -> str:
        text = f"SafeConv1D(nf={self.nf}, nx={self.nx}"
        text += f", mode={self.mode!r}" if self.mode is not None else ""
        text += ", scan_grad=True" if self.scan_grad else ""
        text += f", dtype_policy={self.dtype_policy!r}" if self.dtype_policy != "strict" else ""
        return text + ")"

    def __init__(
        self,
        nf: int,
        nx: int,
        *,
        mode: str | None = None,
        name: str | None = None,
        scan_grad: bool = False,
        dtype_policy: str = "strict",
    ) -> None:
        super().__init__(nf, nx)  # type: ignore[call-arg]  (transformers' Conv1D)
        self.__dict__.update(_checked_options(mode, name, scan_grad, dtype_policy))


_CONV1D_CLASS: type | None = None


def _conv1d_class() -> type:
    """SafeConv1D's real class: _GuardedConv1D over transformers' Conv1D (imported here, when a
    Conv1D is first guarded; the package never imports transformers by itself)."""
    global _CONV1D_CLASS
    if _CONV1D_CLASS is None:
        from transformers.pytorch_utils import Conv1D

        _CONV1D_CLASS = type(
            "SafeConv1D",
            (_GuardedConv1D, Conv1D, SafeConv1D),
            {"__module__": __name__, "__qualname__": _CONV1D_CLASS_NAME, "__doc__": SafeConv1D.__doc__},
        )
    return _CONV1D_CLASS


# The name pickle finds the class under (a model saved whole): resolved by __getattr__ below.
_CONV1D_CLASS_NAME = "_SafeConv1DOverTransformers"


def __getattr__(name: str) -> Any:
    if name == _CONV1D_CLASS_NAME:
        return _conv1d_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_conv1d(module: Any) -> bool:
    """Exactly transformers' ``Conv1D`` (not a subclass, not already guarded)."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"


def is_guarded(module: Any) -> bool:
    """A SafeLinear or a SafeConv1D."""
    return isinstance(module, (SafeLinear, SafeConv1D))


def retyped(module: nn.Module, cls: type, drop: tuple[str, ...] = ()) -> Any:
    """A module of class ``cls`` holding ``module``'s state: the same Parameter objects,
    buffers, submodules and hook dicts (new containers for the containers), minus ``drop``."""
    new = cls.__new__(cls)
    own = new.__dict__
    for key, value in module.__dict__.items():
        if key in drop:
            continue
        own[key] = value.copy() if key in _COPIED_STATE else value
    return new
