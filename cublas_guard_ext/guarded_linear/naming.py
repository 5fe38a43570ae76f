"""The name a guarded layer's errors use: its path in the model it runs in, now.

``replace_linear`` and ``name_layers`` give each guarded layer its qualified name once, and models
change afterwards: PEFT's ``merge_and_unload`` puts the base layer where its LoRA wrapper was and
returns the inner model; ``torch.compile``, DDP and FSDP wrap the model (``_orig_mod.``,
``module.``, ``_fsdp_wrapped_module.``); a block is moved into another model by hand. So the name
is checked when an error is built, and derived again when it no longer names the layer. Errors
are rare: the forward pays nothing for this.

A name is kept while it still names the layer from some module that holds it now: a model on
this thread's stack (a forward, eager or compiled: Dynamo keeps the modules' call frames), or
any module above the layer along the parent links kept here (a model named with a prefix, a
block called by itself, a LightningModule holding the named model as ``net``). The links are
those of every model ``name_layers`` named, and every registration since of a guarded layer or
of a module above one (torch's module-registration hook: ``merge_and_unload``'s setattr, DDP's
``self.module = model``, a block moved by hand); a link is followed only while the parent still
holds the child under that name, so one that went stale is never used. Otherwise the layers are
named again (``name_layers``) in the model it runs in: the outermost running model holding it,
else (a backward, a deferred report at ``check()``: no model on the stack) the largest module
the links reach. A name set by hand is always kept. Wrappers are looked through, never named:
the compiled model's ``_orig_mod``, DDP's and DataParallel's ``module``, FSDP's
``_fsdp_wrapped_module``, the activation checkpoint wrapper's ``_checkpoint_wrapped_module``.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["current_name", "find_layer", "layers_named", "remember", "strip_wrappers", "use_name_layers"]

# Children -> the (parent, name) pairs they were registered under. Weak on both sides: a link
# never keeps a model alive.
_PARENTS: weakref.WeakKeyDictionary[nn.Module, list[tuple[weakref.ref[nn.Module], str]]] = (
    weakref.WeakKeyDictionary()
)
# Modules that are a parent in some link: a registration of one of them is recorded too.
_ANCESTORS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# The prefix each model was named with (name_layers(model, prefix=...)).
_PREFIXES: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()

# A wrapper's slot for the model it wraps: (class name or None for any class, slot).
_WRAPPER_SLOTS = (
    (None, "_orig_mod"),  # torch.compile's OptimizedModule
    (None, "_fsdp_wrapped_module"),  # FSDP (1)
    (None, "_checkpoint_wrapped_module"),  # torch.distributed's checkpoint_wrapper
    ("DistributedDataParallel", "module"),
    ("DataParallel", "module"),
)
_MAX_DEPTH = 64

# nn.py's name_layers, handed in when nn.py is imported (it imports this module: no cycle).
_NAME_LAYERS: Callable[[nn.Module, str], Any] | None = None


def use_name_layers(name_layers: Callable[[nn.Module, str], Any]) -> None:
    """How a model's layers are named again (nn.py hands in its name_layers)."""
    global _NAME_LAYERS
    _NAME_LAYERS = name_layers


def _is_wrapper_slot(parent: nn.Module, name: str) -> bool:
    cls = type(parent).__name__
    return any(name == slot and (owner is None or owner == cls) for owner, slot in _WRAPPER_SLOTS)


def strip_wrappers(model: nn.Module, path: str) -> str:
    """``path`` (a qualified name in ``model``) without the wrappers' segments."""
    parts, kept, module = path.split(".") if path else [], [], model
    for part in parts:
        if module is not None and not _is_wrapper_slot(module, part):
            kept.append(part)
        module = module._modules.get(part) if module is not None else None
    return ".".join(kept)


def _unwrapped(module: nn.Module) -> nn.Module:
    """The model inside torch.compile / DDP / FSDP-style wrappers."""
    for _ in range(_MAX_DEPTH):
        inner = next((module._modules[s] for s in _slots(module) if module._modules.get(s) is not None), None)
        if inner is None:
            return module
        module = inner
    return module


def _slots(module: nn.Module) -> list[str]:
    cls = type(module).__name__
    return [slot for owner, slot in _WRAPPER_SLOTS if owner is None or owner == cls]


# -- the parent links -------------------------------------------------------------------------
def _link(parent: nn.Module, name: str, child: nn.Module) -> None:
    links = _PARENTS.get(child)
    if links is None:
        links = _PARENTS.setdefault(child, [])
    for ref, known in links:
        if known == name and ref() is parent:
            return
    links[:] = [(ref, known) for ref, known in links if ref() is not None]
    links.append((weakref.ref(parent), name))
    _ANCESTORS.add(parent)


def remember(model: nn.Module, prefix: str = "") -> None:
    """Record every parent link of ``model``'s tree, and the prefix its layers were named with
    (name_layers calls it)."""
    if prefix:
        _PREFIXES[model] = prefix
    else:
        _PREFIXES.pop(model, None)
    for module in model.modules():
        for name, child in module._modules.items():
            if child is not None:
                _link(module, name, child)


def _on_registration(parent: nn.Module, name: str, child: Any) -> None:
    """torch's module-registration hook: a guarded layer, or a module above one, registered
    somewhere is linked there (one isinstance and two weak lookups otherwise; never replaces
    the module)."""
    # Under torch.compile the hook fires inside traced code (transformers' MoE models slice
    # self.layers, a ModuleList built per call), where dynamo cannot trace the weak sets: a
    # transient container needs no link, so tracing skips the hook's body.
    if torch.compiler.is_compiling() or not isinstance(child, nn.Module):
        return None
    if child in _PARENTS or child in _ANCESTORS or _is_guarded(child):
        _link(parent, name, child)
    return None


def _is_guarded(module: Any) -> bool:
    return hasattr(type(module), "guard_label")  # SafeLinear, SafeConv1D (nn.py)


_REGISTRATION_HOOK = nn.modules.module.register_module_module_registration_hook(_on_registration)


def _holders(child: nn.Module) -> list[tuple[nn.Module, str]]:
    """The links of ``child`` that still hold: the parent is alive and has it under that name."""
    out = []
    for ref, name in list(_PARENTS.get(child) or ()):
        parent = ref()
        if parent is not None and parent._modules.get(name) is child:
            out.append((parent, name))
    return out


def _upward(
    layer: nn.Module, running: set[int] | None = None
) -> tuple[set[str], list[tuple[nn.Module, str]]]:
    """From ``layer`` up the links that hold: every path to it from a module above (without
    wrapper segments), and the roots with the layer's path in each. With ``running`` (the ids of
    the modules running on the stack, the layer's own call left out), only the paths that pass
    through a running module count: the model that runs it, not an old one still holding it."""
    paths: set[str] = set()
    roots: list[tuple[nn.Module, str]] = []
    frontier: list[tuple[nn.Module, str, int, bool]] = [(layer, "", 0, running is None)]
    seen: set[tuple[int, str]] = set()
    while frontier:
        module, path, depth, counts = frontier.pop()
        counts = counts or (running is not None and id(module) in running)
        holders = [(p, n) for p, n in _holders(module)] if depth < _MAX_DEPTH else []
        above = [(p, n) for p, n in holders if not _is_wrapper_slot(p, n)]
        if module in _PREFIXES and path and counts:
            paths.add(f"{_PREFIXES[module]}.{path}")
        if not above:
            roots.append((module, path))
            continue
        for parent, name in above:
            longer = f"{name}.{path}" if path else name
            if (id(parent), longer) in seen:
                continue
            seen.add((id(parent), longer))
            if counts or id(parent) in (running or ()):
                paths.add(longer)
            frontier.append((parent, longer, depth + 1, counts))
    return paths, roots


# -- the modules running now ------------------------------------------------------------------
# The frames of a module call (torch.nn.Module's __call__ path): their `self` is the module.
# The one place the package reads them (run's Linear and the guarded experts name their
# layers from the outermost one too).
MODULE_CALL_CODES = frozenset({nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__})


def outermost_module_called() -> nn.Module | None:
    """The outermost module whose call is on this thread's Python stack (the model), or None."""
    running = _modules_on_stack()
    return running[0] if running else None


def _modules_on_stack() -> list[nn.Module]:
    """The modules being called on this thread's stack, outermost first: the model the user
    called, its wrappers, its blocks. Read only when an error is being built or a layer is
    named on its first call, and only from the module-call frames (reading a frame's locals
    copies them all: a dict per frame otherwise)."""
    frame = sys._getframe(1)
    found: list[nn.Module] = []
    while frame is not None:
        if frame.f_code in MODULE_CALL_CODES:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, nn.Module) and all(candidate is not m for m in found):
                found.append(candidate)
        frame = frame.f_back
    return found[::-1]


def _on_stack(label: str) -> tuple[nn.Module | None, nn.Module | None, set[str], set[int]]:
    """(the layer, the outermost running model holding it, its paths from the running models,
    the ids of the running modules but the layer): the layer labelled ``label`` as the modules
    on this thread's stack see it."""
    layer, root, paths = None, None, set()
    running = _modules_on_stack()
    for model in running:
        for name, module in model.named_modules():
            if _is_guarded(module) and module.guard_name == label and (layer is None or module is layer):
                layer = module
                root = root if root is not None else _unwrapped(model)
                if name:  # (the layer itself, called alone, cannot tell where it sits)
                    paths.add(strip_wrappers(model, name))
                break
    return layer, root, paths, {id(m) for m in running if m is not layer}


def layers_named(label: str) -> list[nn.Module]:
    """The guarded layers known here (linked into some module) whose label is ``label``."""
    return [m for m in list(_PARENTS.keys()) if _is_guarded(m) and m.guard_label == label]


def find_layer(label: str) -> nn.Module | None:
    """The guarded layer labelled ``label``: in the modules running on this thread's stack
    first (the model of the error), else the one known layer with that label; None when there
    is none or several (two models with layers of that name)."""
    for model in _modules_on_stack():
        for module in model.modules():
            if _is_guarded(module) and module.guard_label == label:
                return module
    layers = layers_named(label)
    return layers[0] if len(layers) == 1 else None


def current_name(label: str) -> str | None:
    """The layer's current name when ``label`` (an error's ``layer``) no longer names it, else
    None. Renames every layer the model's ``name_layers`` named, as ``name_layers`` would now."""
    if not label:
        return None
    layer, root, paths, running = _on_stack(label)
    if layer is None:
        layers = layers_named(label)
        if len(layers) != 1:  # none known, or two models with layers of that name: cannot tell
            return None
        layer = layers[0]
    if layer.__dict__.get("_auto_guard_name") != label:
        return None  # a name set by hand is kept
    above, roots = _upward(layer, running if root is not None else None)
    if layer not in _PARENTS and any(label.endswith("." + p) for p in paths):
        # a layer never linked (a deep copy, a model loaded whole): the modules above the ones
        # running are unknown, so a name ending with its path there is taken to be its path
        # from one of them (a block of the named model called by itself)
        return None
    paths |= above
    if not paths or label in paths:
        return None  # held by nothing known, or the name still holds from some module
    if root is None:
        root = max(roots, key=lambda item: sum(1 for _ in item[0].modules()))[0]
    if _NAME_LAYERS is None:
        return None
    _NAME_LAYERS(root, _PREFIXES.get(root, ""))
    return layer.guard_name if layer.guard_name != label else None
