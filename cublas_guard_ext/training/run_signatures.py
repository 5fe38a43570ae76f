"""What one run of a training step computed, module by module, as signatures on the device.

A :class:`Recorder` is installed only for a checked step or a rerun, never on a healthy
step. Each event is ``(module, phase, what, call)`` with :func:`signatures.stats` of the
tensors (order-sensitive hash, non-finite count, finite absmax, 2-norm), in the order the
run produced them:

* ``forward`` / ``output``: a module's output (every tensor in it), from a forward hook;
  forward hooks run innermost first, so a value a child returns to its parent is named at
  the child;
* ``backward`` / ``input gradient``: the gradient arriving at a module's input tensors, from
  a tensor hook registered in the forward hook (innermost module first; a tensor hooked once);
* ``backward`` / ``gradient of <parameter>``: a parameter's gradient as autograd computed it
  on this rank, before DDP or FSDP reduces it (a tensor hook on the parameter).

For a Linear-like module (``nn.Linear``, ``SafeLinear``, GPT-2's ``Conv1D``) these three are
its three GEMMs: the forward GEMM, ``grad_input`` and ``grad_weight`` (:func:`gemm_of`).

A :class:`Capture` keeps the operands of one GEMM of one module call (for the capsule).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from . import signatures

__all__ = ["Recorder", "Record", "Capture", "is_gemm_module", "gemm_of", "compare"]

_GEMM_TEXT = {
    "output": "forward GEMM (input x weight^T + bias)",
    "input gradient": "grad_input GEMM (grad_output x weight)",
    "gradient of weight": "grad_weight GEMM (grad_output^T x input)",
}
_CAPSULE_PHASE = {"output": "forward", "input gradient": "grad_input", "gradient of weight": "grad_weight"}


def is_gemm_module(module: torch.nn.Module) -> bool:
    """A module whose forward is one GEMM: nn.Linear (SafeLinear), Conv1D (SafeConv1D)."""
    if isinstance(module, torch.nn.Linear):
        return True
    return type(module).__name__ in ("Conv1D", "SafeConv1D") and hasattr(module, "weight")


def gemm_of(module: torch.nn.Module | None, what: str) -> str | None:
    """The GEMM an event of a Linear-like module is the result of, in words; else None."""
    if module is None or not is_gemm_module(module):
        return None
    text = _GEMM_TEXT.get(what)
    if text is None:
        return None
    # SafeLinear's is the guarded op; a plain nn.Linear's is torch's (or, under `run`, the
    # guarded op too): its name is not known from the module alone
    op = "cublas_guard::linear in " if hasattr(module, "guard_name") else "in "
    return f"{text}, {op}{type(module).__name__}"


def capsule_phase(what: str) -> str | None:
    return _CAPSULE_PHASE.get(what)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _stats_of(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [signatures.stats(t) for t in tensors]
    if len(parts) == 1:
        return parts[0]
    device = parts[0][0].device
    ints = torch.stack([p[0].to(device) for p in parts])
    floats = torch.stack([p[1].to(device) for p in parts])
    return (
        torch.stack([signatures.combine(ints[:, 0]), ints[:, 1].sum()]),
        torch.stack([floats[:, 0].max(), floats[:, 1].square().sum().sqrt()]),
    )


@dataclass
class Record:
    """One run's events (keys on the host, values on the device until :meth:`read`)."""

    keys: list[tuple[str, str, str, int]] = field(default_factory=list)
    ints: list[torch.Tensor] = field(default_factory=list)
    floats: list[torch.Tensor] = field(default_factory=list)
    values: tuple[list[list[int]], list[list[float]]] | None = None

    def add(self, key: tuple[str, str, str, int], tensors: list[torch.Tensor]) -> None:
        if not tensors:
            return
        i, f = _stats_of(tensors)
        self.keys.append(key)
        self.ints.append(i)
        self.floats.append(f)

    def read(self) -> tuple[list[list[int]], list[list[float]]]:
        """The values on the host (two reads for the whole run; only on the rerun path)."""
        if self.values is None:
            if not self.keys:
                self.values = ([], [])
            else:
                device = self.ints[0].device
                ints = torch.stack([t.to(device) for t in self.ints]).cpu().tolist()
                floats = torch.stack([t.to(device) for t in self.floats]).cpu().tolist()
                self.values = (ints, floats)
        return self.values


class Recorder:
    """Hooks on every module (and parameter) of ``model`` that add events to ``record``."""

    def __init__(self, model: torch.nn.Module, record: Record, parameters: bool = True) -> None:
        self.model = model
        self.record = record
        self.parameters = parameters
        self.handles: list[Any] = []
        self.calls: dict[str, int] = {}
        # tensors already hooked, by id (weak: a freed tensor's id may come back in this run)
        self.hooked: dict[int, weakref.ref] = {}

    def _post(self, name: str, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        self.record.add((name, "forward", "output", call), _tensors(output))
        if not torch.is_grad_enabled():
            return
        for t in _tensors((args, kwargs)):
            seen = self.hooked.get(id(t))
            if t.requires_grad and (seen is None or seen() is not t):
                self.hooked[id(t)] = weakref.ref(t)
                key = (name, "backward", "input gradient", call)
                self.handles.append(t.register_hook(lambda g, key=key: self.record.add(key, [g])))

    def __enter__(self) -> Recorder:
        for name, module in self.model.named_modules():
            hook = (lambda n: lambda m, a, k, o: self._post(n, m, a, k, o))(name)
            self.handles.append(module.register_forward_hook(hook, with_kwargs=True))
        if self.parameters:
            for pname, p in self.model.named_parameters():
                if not p.requires_grad or hasattr(p, "to_local"):
                    continue  # FSDP2 computes with unsharded copies: their gradients are local events
                module, _, leaf = pname.rpartition(".")
                key_base = (module, "backward", f"gradient of {leaf}")

                def hook(g: torch.Tensor, base=key_base) -> None:
                    self.record.add((*base, self.calls.get(base[0], 1) - 1), [g])

                self.handles.append(p.register_hook(hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.hooked.clear()


class Capture:
    """Keep CPU copies of the operands and the result of one GEMM of one call of one module;
    ``what`` is the event's ("output", "input gradient", "gradient of weight").
    ``operands`` are laid out as the capsule wants them (a Linear's weight ``[out, in]``);
    ``call_params`` as the module holds them (for a replay through the module's own forward)."""

    def __init__(self, model: torch.nn.Module, module_name: str, what: str, call: int) -> None:
        self.module = dict(model.named_modules())[module_name]
        self.what, self.call = what, call
        self.operands: dict[str, torch.Tensor] = {}
        self.call_params: dict[str, torch.Tensor] = {}
        self.result: torch.Tensor | None = None
        self.handles: list[Any] = []
        self.seen = 0

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        call = self.seen
        self.seen += 1
        if call != self.call or not args or not isinstance(args[0], torch.Tensor):
            return
        x = args[0].detach().cpu().clone()
        held = module.weight.detach()
        held = (held.full_tensor() if hasattr(held, "full_tensor") else held).cpu().clone()
        weight = held if isinstance(module, torch.nn.Linear) else held.t()  # Conv1D: [in, out]
        bias = getattr(module, "bias", None)
        bias = bias.detach().cpu().clone() if isinstance(bias, torch.Tensor) else None
        self.call_params = {"weight": held, **({"bias": bias} if bias is not None else {})}
        if self.what == "output":
            self.operands = {"input": x, "weight": weight, **({"bias": bias} if bias is not None else {})}
            self.result = output.detach().cpu().clone() if isinstance(output, torch.Tensor) else None
            return
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return

        def on_grad(g: torch.Tensor) -> None:
            self.operands = {"grad_output": g.detach().cpu().clone(), "weight": weight}
            if self.what == "gradient of weight":
                self.operands["input"] = x

        self.handles.append(output.register_hook(on_grad))

    @contextlib.contextmanager
    def installed(self) -> Iterator[Capture]:
        self.handles.append(self.module.register_forward_hook(self._post))
        try:
            yield self
        finally:
            for h in self.handles:
                h.remove()
            self.handles.clear()


def compare(a: Record, b: Record, tolerance: float | None) -> tuple[int | None, float]:
    """(index of the first event where runs ``a`` and ``b`` differ, or None; the largest
    relative difference of their absmax / 2-norm over all events). ``tolerance`` None: bitwise
    (hash and counts equal); else the floats may differ by that relative amount and the
    non-finite counts must agree (the hash of a non-deterministic kernel's output is noise)."""
    ai, af = a.read()
    bi, bf = b.read()
    first = None
    worst = 0.0
    for k in range(max(len(a.keys), len(b.keys))):
        if k >= len(a.keys) or k >= len(b.keys) or a.keys[k] != b.keys[k]:
            return (k if first is None else first), float("inf")
        rel = max(_rel(x, y) for x, y in zip(af[k], bf[k], strict=True))
        worst = max(worst, rel)
        if tolerance is None:
            same = ai[k] == bi[k]
        else:
            same = ai[k][1] == bi[k][1] and rel <= tolerance
        if not same and first is None:
            first = k
    return first, worst


def _rel(x: float, y: float) -> float:
    if x == y:
        return 0.0
    scale = max(abs(x), abs(y))
    return abs(x - y) / scale if scale else 0.0
