"""torchao's ``Float8Linear`` guarded, FP8 kept: its three GEMMs (forward, grad_input,
grad_weight) run exactly torchao's code, and every operand cast to float8 on the way is checked.

How: :class:`GuardedFloat8Linear` is ``Float8Linear`` with one change, its autograd function.
``_GuardedMatmul`` subclasses torchao's ``matmul_with_hp_or_float8_args`` and runs its forward and
backward as they are, with this thread's "current GEMM" set; torchao's module-level
``hp_tensor_to_float8_dynamic`` (the one cast every operand of the three GEMMs goes through) is
wrapped once: outside a guarded GEMM it is torchao's own; inside, it runs torchao's two steps
itself (``tensor_to_amax`` then ``amax_to_scale``, then ``hp_tensor_and_scale_to_float8``: the same
calls ``tensor_to_scale`` makes, so outputs and gradients are bitwise torchao's) and hands the
amax, the scale and the codes to :mod:`.checks`.

Guarding retypes the module in place (the same object, Parameters and optimizer state);
:func:`unguard` gives ``Float8Linear`` back. Imported only when torchao is (``fp8/__init__``).
Under ``torch.compile`` the layer runs torchao's forward unchecked (docs/fp8.md).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torchao
from torchao.float8 import float8_linear as _ao_linear
from torchao.float8.config import Float8LinearConfig, Float8LinearRecipeName, ScalingGranularity, ScalingType
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

from ..guarded_linear import modes
from .checks import Checker, Where, inside_checked_gemm
from .formats import format_of

ATTRIBUTES = ("guard_name", "mode", "_cublas_guard_fp8_recipe")
_state = threading.local()
_original_cast = _ao_linear.hp_tensor_to_float8_dynamic
# One checker for every guarded layer: an async verdict is read at the next guarded float8 call,
# whichever layer makes it (as the guarded Linear's async mode), or by fp8.check().
CHECKS = Checker()


class _Active:
    """The guarded GEMM(s) running on this thread: which layer, which pass."""

    def __init__(self, module: GuardedFloat8Linear, backward: bool) -> None:
        self.module = module
        self.backward = backward
        self.grad_outputs_seen = 0


@contextmanager
def _active(module: GuardedFloat8Linear, backward: bool) -> Iterator[None]:
    previous = getattr(_state, "active", None)
    _state.active = _Active(module, backward)
    try:
        with inside_checked_gemm():
            yield
    finally:
        _state.active = previous


def _gemm_and_operand(active: _Active, role: GemmInputRole) -> tuple[str, str]:
    if not active.backward:
        return "forward", "input" if role is GemmInputRole.INPUT else "weight"
    if role is GemmInputRole.WEIGHT:
        return "grad_input", "weight"
    if role is GemmInputRole.INPUT:
        return "grad_weight", "input"
    config = active.module.config
    first_is_grad_input = config.cast_config_grad_output.scaling_type is not ScalingType.DISABLED
    active.grad_outputs_seen += 1
    if active.grad_outputs_seen == 1 and first_is_grad_input:
        return "grad_input", "grad_output"
    return "grad_weight", "grad_output"


def _checked_cast(
    hp_tensor: torch.Tensor,
    float8_dtype: torch.dtype,
    linear_mm_config: Any,
    reduce_amax: bool = False,
    gemm_input_role: GemmInputRole = GemmInputRole.INPUT,
    device_mesh: Any = None,
    scaling_granularity: Any = None,
    axiswise_dim: int | None = None,
    round_scales_to_power_of_2: bool = False,
) -> Any:
    """torchao's ``hp_tensor_to_float8_dynamic``, checked inside a guarded GEMM."""
    active = getattr(_state, "active", None)
    kwargs = {"scaling_granularity": scaling_granularity} if scaling_granularity is not None else {}
    if active is None:
        return _original_cast(
            hp_tensor,
            float8_dtype,
            linear_mm_config,
            reduce_amax,
            gemm_input_role,
            device_mesh,
            axiswise_dim=axiswise_dim,
            round_scales_to_power_of_2=round_scales_to_power_of_2,
            **kwargs,
        )
    amax = _amax(hp_tensor, reduce_amax, device_mesh, scaling_granularity, axiswise_dim)
    scale = amax_to_scale(amax, float8_dtype, round_scales_to_power_of_2=round_scales_to_power_of_2)
    out = hp_tensor_and_scale_to_float8(
        hp_tensor, scale, float8_dtype, linear_mm_config, gemm_input_role, axiswise_dim
    )
    module = active.module
    gemm, operand = _gemm_and_operand(active, gemm_input_role)
    fmt = format_of(float8_dtype)
    if fmt is not None:
        where = Where(operand, layer=module.guard_name, gemm=gemm, recipe=module.recipe)
        CHECKS.operand(module.guard_mode(), where, hp_tensor, amax, scale, out._data, fmt)
    return out


def _amax(x: torch.Tensor, reduce_amax: bool, mesh: Any, granularity: Any, dim: int | None) -> torch.Tensor:
    """torchao's ``tensor_to_amax`` (``max(abs(x))``), for tensorwise scaling read in one pass:
    ``max(max(x), -min(x))`` from one ``aminmax`` is the same value exactly (NaN propagates as in
    torchao's) at a fraction of abs + max on the CPU: the pass the checks then spend on the codes.
    Per row (axiswise) ``aminmax`` measured slower than torchao's abs + amax (a rowwise step 1.14x
    vs 0.97x, benchmarks/RESULTS.md), so rows, and a cross-rank amax reduction, use torchao's."""
    if reduce_amax or not (granularity is None or granularity is ScalingGranularity.TENSORWISE):
        kwargs = {"scaling_granularity": granularity} if granularity is not None else {}
        return tensor_to_amax(x, reduce_amax, mesh, axiswise_dim=dim, **kwargs)
    with torch.no_grad():
        low, high = torch.aminmax(x)
        return torch.maximum(high, low.neg())


class _GuardedMatmul(matmul_with_hp_or_float8_args):
    """torchao's Float8Linear autograd function, run with the current GEMM set for the checks."""

    @staticmethod
    def forward(
        ctx: Any, input_hp: torch.Tensor, weight_hp_t: torch.Tensor, mm_config: Any, config: Any, module: Any
    ) -> Any:
        ctx.guarded_module = module
        with _active(module, backward=False):
            return matmul_with_hp_or_float8_args.forward(ctx, input_hp, weight_hp_t, mm_config, config)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        with _active(ctx.guarded_module, backward=True):
            grads = matmul_with_hp_or_float8_args.backward(ctx, grad_output)
        return (*grads, None)


def recipe_of(config: Float8LinearConfig) -> str:
    """The torchao recipe a config is (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``), else ``custom``."""
    for recipe in Float8LinearRecipeName:
        try:
            if Float8LinearConfig.from_recipe_name(recipe) == config:
                return recipe.value
        except Exception:  # a recipe this torchao cannot build: not this one
            continue
    return "custom"


class GuardedFloat8Linear(Float8Linear):
    """A torchao ``Float8Linear`` whose three FP8 GEMMs are checked (see the module's docstring)."""

    @property
    def recipe(self) -> str:
        return self.__dict__["_cublas_guard_fp8_recipe"]

    def guard_mode(self) -> str:
        mode = self.__dict__.get("mode")
        return mode if mode is not None else modes.current()

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's name)
        if CHECKS.pending:
            CHECKS.check()
        if torch.compiler.is_compiling():
            return Float8Linear.forward(self, input)
        if torch.is_autocast_enabled():  # as torchao's forward does
            input = input.to(torch.get_autocast_gpu_dtype())
        output = _GuardedMatmul.apply(input, self.weight.t(), self.linear_mm_config, self.config, self)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output


def is_float8_linear(module: Any) -> bool:
    """Exactly torchao's Float8Linear (subclasses keep their type: their forward may differ)."""
    return type(module) is Float8Linear


def is_guarded(module: Any) -> bool:
    return type(module) is GuardedFloat8Linear


def guard(module: Float8Linear, name: str, mode: str | None) -> GuardedFloat8Linear:
    """Retype ``module`` in place into a GuardedFloat8Linear named ``name``."""
    _install_cast()
    module.__dict__["guard_name"] = name
    module.__dict__["mode"] = mode
    module.__dict__["_cublas_guard_fp8_recipe"] = recipe_of(module.config)
    module.__class__ = GuardedFloat8Linear
    return module  # type: ignore[return-value]


def unguard(module: GuardedFloat8Linear) -> Float8Linear:
    CHECKS.check(wait=True)
    for key in ATTRIBUTES:
        module.__dict__.pop(key, None)
    module.__class__ = Float8Linear
    return module


def check_layers() -> None:
    """Read every pending async check of the guarded Float8Linear layers (waiting)."""
    CHECKS.check(wait=True)


def _install_cast() -> None:
    if _ao_linear.hp_tensor_to_float8_dynamic is not _checked_cast:
        _ao_linear.hp_tensor_to_float8_dynamic = _checked_cast


VERSION = torchao.__version__
