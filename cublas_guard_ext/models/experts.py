"""A mixture of experts' expert GEMMs through the guard: transformers' experts modules.

In transformers 5 an experts module (Mixtral, Qwen2/3-MoE, DeepSeek, gpt-oss, OLMoE, ...) holds
its experts as 3-D Parameters (``gate_up_proj`` [experts, 2*intermediate, hidden],
``down_proj`` [experts, hidden, intermediate], or transposed, with or without a gate and
biases) and runs them through an implementation chosen by name in
``transformers.integrations.moe.ExpertsInterface`` on every call. This module adds one more,
``"cublas_guard"``: the routing is the model's own (the experts get the router's
``top_k_index`` and ``top_k_weights`` as with any implementation); the tokens are sorted by
expert as transformers' ``grouped_mm`` does, and both projections run through the guarded
grouped GEMM ``torch.ops.cublas_guard.grouped_linear``: the routed tokens and the expert
weights scanned (the weights only when they changed), one checked GEMM per expert, rows no
expert owns zeroed, errors naming the experts module, the expert and the parameter.

* :func:`grouped_linear`: the op, typed.
* ``model.set_experts_implementation("cublas_guard")`` works once this package is imported
  (the name is registered when transformers' ``integrations.moe`` is, before or after);
  :func:`cublas_guard_ext.replace_linear` selects it for every experts module of a model
  (:func:`guard_experts`) and :func:`cublas_guard_ext.restore_linear` gives back the one
  the model had (:func:`restore_experts`).
* ``python -m cublas_guard_ext run`` guards every experts module of the process
  (:func:`install_everywhere`): transformers' own GEMM implementations resolve to this one.

transformers is never imported here: it is optional, and only its modules already loaded are read.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch import nn

from .._import_hooks import AfterImport
from ..errors import ExpertsImplementationError
from ..guarded_linear import modes
from ..guarded_linear import naming as _naming
from ..guarded_linear import ops as _ops  # noqa: F401  (loads the native library)

__all__ = [
    "IMPLEMENTATION",
    "grouped_linear",
    "guarded_experts_forward",
    "is_hf_experts",
    "implementation_of",
    "is_guarded_experts",
    "guard_experts",
    "restore_experts",
    "register",
]

IMPLEMENTATION = "cublas_guard"
# transformers' implementations that run torch's own GEMMs (None: a standalone experts
# module, which transformers runs eagerly): what the guarded one stands in for. The others
# (deepgemm, sonicmoe, the fp8 ones) are kernels of their own, left as chosen.
GUARDABLE = (None, "eager", "batched_mm", "grouped_mm")
_MOE_MODULE = "transformers.integrations.moe"

# Attributes this package keeps on an experts module (never in its state_dict or config).
NAME_ATTR = "_cublas_guard_experts_name"  # its qualified name, what errors call it
MODE_ATTR = "_cublas_guard_experts_mode"  # replace_linear's mode= (None: the default mode)
PREVIOUS_ATTR = "_cublas_guard_experts_previous"  # the implementation before replace_linear
_GROUPED = torch.ops.cublas_guard.grouped_linear.default  # (loaded by .ops)
_MODE_CODES = modes.MODE_CODES


# -- the op --------------------------------------------------------------------------------------
def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    layer: str = "",
    parameter: str = "",
    mode: str | None = None,
    transposed: bool = False,
) -> torch.Tensor:
    """The guarded grouped GEMM: rows ``offs[e-1]:offs[e]`` of ``x`` (sorted by expert) times
    expert ``e``'s weight, plus its bias; rows from ``offs[-1]`` on are zero.

    ``weight``: [experts, out, in] (``nn.Linear``'s layout per expert), or [experts, in, out]
    with ``transposed=True``; ``bias``: [experts, out]; ``offs``: int32 cumulative group ends,
    one per expert (what ``torch.nn.functional.grouped_mm`` takes). ``layer`` and ``parameter``
    name the experts module and the weight in errors. Gradients flow to ``x``, ``weight`` and
    ``bias``; under ``torch.autocast`` the operands are cast as ``nn.Linear``'s are.
    """
    code = _MODE_CODES[modes.validate(mode) if mode is not None else modes.current()]
    return _GROUPED(x, weight, bias, offs, layer, parameter, code, transposed)


# -- which modules are transformers' experts -------------------------------------------------------
_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def is_hf_experts(module: Any) -> bool:
    """An experts module of transformers' ``@use_experts_implementation`` (its forward
    dispatches on ``config._experts_implementation``)."""
    if not isinstance(module, nn.Module) or not all(name in module.__dict__ for name in _FLAGS):
        return False
    config = module.__dict__.get("config")
    return config is not None and hasattr(config, "_experts_implementation")


def implementation_of(module: nn.Module) -> Any:
    """The implementation the experts module's config names now."""
    return module.config._experts_implementation


def is_guarded_experts(module: Any) -> bool:
    """Whether an experts module's next forward runs through the guard."""
    if not is_hf_experts(module):
        return False
    implementation = implementation_of(module)
    return implementation == IMPLEMENTATION or (_everywhere["on"] and implementation in GUARDABLE)


def _set_implementation(config: Any, value: Any) -> None:
    """This config's implementation only (not its sub-configs). transformers 5 keeps it behind a
    property whose setter recurses into the sub-configs; early 5.x releases as a plain attribute
    (their set_experts_implementation refuses a registered name: this does not ask it)."""
    if isinstance(getattr(type(config), "_experts_implementation", None), property):
        config._experts_implementation_internal = value
    else:
        config._experts_implementation = value


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    seen: set[int] = set()
    found = []
    for name, module in model.named_modules():
        if id(module) not in seen and is_hf_experts(module):
            seen.add(id(module))
            found.append((name, module))
    return found


def name_experts(model: nn.Module) -> None:
    """Give every experts module of ``model`` its qualified name (errors use it)."""
    for name, module in _experts_modules(model):
        module.__dict__[NAME_ATTR] = name or type(module).__name__


def guard_experts(model: nn.Module, names: set[str] | None = None, mode: str | None = None) -> list[str]:
    """Select the ``cublas_guard`` implementation for the experts modules of ``model`` (all, or
    those named in ``names``); returns the qualified names guarded.

    The implementation is chosen per config, as transformers chooses it: every experts module
    sharing a config with a selected one is guarded too. Each keeps the implementation it had,
    for :func:`restore_experts`. Modules running another kernel (deepgemm, sonicmoe, fp8) are
    left as they are (coverage() says so).
    """
    register()
    chosen = [
        (name, module)
        for name, module in _experts_modules(model)
        if (names is None or name in names) and implementation_of(module) in (*GUARDABLE, IMPLEMENTATION)
    ]
    configs = {id(module.config): module.config for _, module in chosen}
    guarded = []
    for name, module in _experts_modules(model):
        if id(module.config) not in configs:
            continue
        previous = implementation_of(module)
        if previous != IMPLEMENTATION or PREVIOUS_ATTR not in module.__dict__:
            module.__dict__.setdefault(PREVIOUS_ATTR, previous)
        module.__dict__[MODE_ATTR] = mode
        module.__dict__[NAME_ATTR] = name or type(module).__name__
        guarded.append(name)
    for config in configs.values():
        _set_implementation(config, IMPLEMENTATION)
    return guarded


def restore_experts(model: nn.Module) -> None:
    """Give every experts module :func:`guard_experts` guarded the implementation it had."""
    restored: set[int] = set()
    for _, module in _experts_modules(model):
        if PREVIOUS_ATTR not in module.__dict__:
            continue
        previous = module.__dict__.pop(PREVIOUS_ATTR)
        module.__dict__.pop(MODE_ATTR, None)
        if id(module.config) not in restored and implementation_of(module) == IMPLEMENTATION:
            _set_implementation(module.config, previous)
        restored.add(id(module.config))


# -- naming on first call (a model guarded by set_experts_implementation alone) -----------------------
def _name_of(module: nn.Module) -> str:
    name = module.__dict__.get(NAME_ATTR)
    if name is not None:
        return name
    if torch.compiler.is_compiling():  # no stack to walk in a trace
        return type(module).__name__
    root = _naming.outermost_module_called()
    if root is not None and root is not module:
        root = getattr(root, "_orig_mod", root)  # a torch.compile wrapper
        name_experts(root)
    return module.__dict__.setdefault(NAME_ATTR, type(module).__name__)


# -- the implementation ---------------------------------------------------------------------------------
def guarded_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward through the guarded grouped GEMM.

    The same steps as transformers' ``grouped_mm`` implementation (so the same numbers where
    the same GEMM runs): the (token, expert) pairs sorted by expert, per-expert counts by
    ``histc``, int32 cumulative ends; up (or gate+up) projection, the module's gate or
    activation, down projection; routing weights; the top-k sum as ``view(...).sum(1)``.
    Expert-parallel sentinel ids (>= num_experts) sort last, past the last group end: the op
    returns zeros there and no gradient, and their routing weights are masked as the built-ins
    mask them.
    """
    layer = _name_of(self)
    mode = self.__dict__.get(MODE_ATTR)
    code = _MODE_CODES[mode if mode is not None else modes.current()]
    if self.has_gate:
        up, up_bias, up_name = self.gate_up_proj, getattr(self, "gate_up_proj_bias", None), "gate_up_proj"
    else:
        up, up_bias, up_name = self.up_proj, getattr(self, "up_proj_bias", None), "up_proj"
    down, down_bias = self.down_proj, getattr(self, "down_proj_bias", None)
    if not self.has_bias:
        up_bias = down_bias = None
    if not isinstance(up, torch.Tensor) or up.dim() != 3:
        raise ExpertsImplementationError(
            module=layer,
            module_type=type(self).__name__,
            reason=f"its {up_name} is not a 3-D tensor of stacked experts ({type(up).__name__})",
        )
    transposed = bool(self.is_transposed)
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.size(0), hidden_states.size(-1)

    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    x = hidden_states[perm // num_top_k]
    sample_weights_g = sample_weights[perm]
    # histc, not bincount: no data-dependent size (CUDA graphs), and ids >= num_experts (expert-
    # parallel sentinels) fall outside its range; on the CPU it takes floats (as transformers').
    device = hidden_states.device
    counted = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()
    per_expert = torch.histc(counted, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offs = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
    if getattr(self, "_is_expert_parallel", False):
        sample_weights_g = sample_weights_g.masked_fill(expert_ids_g >= self.num_experts, 0.0)
    # The autocast policy of the op this stands in for: transformers' _grouped_mm casts its input
    # to the weights' dtype and runs torch's grouped GEMM, which autocast leaves alone (under
    # CPU bf16 autocast a float32 model's experts run in float32): so does the guarded op, with
    # autocast off around it (this op is autocast-aware: it would cast to bf16 as nn.Linear).
    autocast = torch.is_autocast_enabled(device.type)
    with torch.autocast(device.type, enabled=False) if autocast else contextlib.nullcontext():
        proj = _GROUPED(x.to(up.dtype), up, up_bias, offs, layer, up_name, code, transposed)
    proj = self._apply_gate(proj) if self.has_gate else self.act_fn(proj)
    with torch.autocast(device.type, enabled=False) if autocast else contextlib.nullcontext():
        proj = _GROUPED(proj.to(down.dtype), down, down_bias, offs, layer, "down_proj", code, transposed)
    if getattr(self, "has_post_expert_norm", False):
        proj = self.post_expert_norm(proj)
    weighted = proj * sample_weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=device)
    weighted = weighted[inv_perm]
    return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


# -- registration with transformers ------------------------------------------------------------------
_everywhere: dict[str, Any] = {"on": False, "original": None}


def register() -> bool:
    """Register ``"cublas_guard"`` in transformers' ExpertsInterface if transformers' MoE
    integration is loaded (a no-op otherwise, and when done). Returns whether it is registered."""
    moe = sys.modules.get(_MOE_MODULE)
    if moe is None or not hasattr(moe, "ExpertsInterface"):
        return False
    interface = moe.ExpertsInterface
    if interface._global_mapping.get(IMPLEMENTATION) is not guarded_experts_forward:
        interface.register(IMPLEMENTATION, guarded_experts_forward)
    if _everywhere["on"] and _everywhere["original"] is None:
        _patch_get_interface(interface)
    return True


# Registers the implementation right after transformers' integrations.moe module ran (whenever
# the script imports it), then leaves sys.meta_path.
_FINDER = AfterImport(_MOE_MODULE, lambda: register())


def register_when_loaded() -> None:
    """Register now if transformers' MoE integration is loaded, else when it is."""
    if not register():
        _FINDER.install()


# -- `python -m cublas_guard_ext run`: every experts module of the process --------------------------------
def _patch_get_interface(interface: type) -> None:
    original = interface.get_interface
    _everywhere["original"] = (interface, original)

    def get_interface(self: Any, experts_implementation: Any, default: Any) -> Any:
        if experts_implementation in GUARDABLE:
            return guarded_experts_forward
        return original(self, experts_implementation, default)

    get_interface.__wrapped__ = original  # type: ignore[attr-defined]
    interface.get_interface = get_interface


def install_everywhere() -> None:
    """Every transformers experts module running one of torch's GEMM implementations (eager,
    batched_mm, grouped_mm: what generation switches between) runs the guarded one instead."""
    _everywhere["on"] = True
    register_when_loaded()


def uninstall_everywhere() -> None:
    _everywhere["on"] = False
    patched = _everywhere["original"]
    if patched is not None:
        interface, original = patched
        interface.get_interface = original
        _everywhere["original"] = None


register_when_loaded()
