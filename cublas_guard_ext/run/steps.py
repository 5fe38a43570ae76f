"""Every ``torch.optim.Optimizer.step`` under ``run``: counted (the report's step number), and
with ``--skip-nonfinite-steps`` / ``--raise-on-nonfinite-steps`` checked first.

The check is TrainingGuard's own fused one (``_training_state._bad_flag``: GradScaler's
multi-tensor non-finite check per device and dtype, one flag, one host read per step). In a
process group of several ranks the flag is all-reduced (MAX) first, as TrainingGuard does, so
every rank decides alike (FSDP's sharded gradients differ per rank). A bad step is skipped by
setting every gradient of the optimizer to None before ``step`` runs: torch's optimizers leave
a parameter without a gradient untouched (no update, no state change, no step count), so the
step changes nothing; or, with ``raise``, :class:`NonFiniteGradientsError` names the step.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..errors import NonFiniteGradientsError
from ..training.state import _bad_flag, _default_group

_lock = threading.Lock()
_counts: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
# The optimizer that stepped first: its count is "the step" of a report.
_first: list[weakref.ref] = []
_handles: list[Any] = []
_after_step_callbacks: list[Any] = []


def completed(optimizer: torch.optim.Optimizer) -> int:
    return _counts.get(optimizer, 0)


def current_step() -> int | None:
    """The step in progress (1-based) of the first optimizer that stepped; None before any."""
    optimizer = _first[0]() if _first else None
    return None if optimizer is None else completed(optimizer) + 1


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _names(optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Parameter names, from the model the run saw last (the report's root)."""
    from . import linear

    root = linear.last_root()
    return {id(p): n for n, p in root.named_parameters()} if root is not None else {}


def _bad_names(optimizer: torch.optim.Optimizer) -> list[str]:
    names = _names(optimizer)
    bad = []
    for p in _params(optimizer):
        g = p.grad
        if g is None:
            continue
        g = g.to_local() if hasattr(g, "to_local") else g
        values = g.coalesce().values() if g.is_sparse else g
        if not bool(torch.isfinite(values).all()):
            bad.append(names.get(id(p), f"<parameter {tuple(p.shape)}>"))
    return bad


def _step_is_bad(optimizer: torch.optim.Optimizer) -> bool:
    grads = [p.grad for p in _params(optimizer) if p.grad is not None]
    flag = _bad_flag(None, grads, True)
    group = _default_group()
    if group is not None:
        import torch.distributed as dist

        flag = torch.zeros(()) if flag is None else flag
        if dist.get_backend(group) == "gloo" and flag.device.type != "cpu":
            flag = flag.cpu()
        flag = flag.reshape(1).clone()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag is not None and bool(flag.item() != 0.0)


def _pre_step(policy: str | None):
    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not _first or _first[0]() is None:
            with _lock:
                _first[:] = [weakref.ref(optimizer)]
        if policy is None or not _step_is_bad(optimizer):
            return None
        step = completed(optimizer) + 1
        bad = _bad_names(optimizer)
        err = NonFiniteGradientsError(
            step=step,
            optimizer=type(optimizer).__name__,
            bad_gradients=bad[:8],
            bad_gradient_count=len(bad),
            loss=None,
            classification=None,
        )
        if policy == "raise":
            raise err
        for p in _params(optimizer):
            p.grad = None
        names = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        warnings.warn(
            f"cublas_guard_ext run: optimizer step {step} skipped: non-finite gradients"
            + (f" in {len(bad)} parameters ({names})" if bad else " on another rank"),
            RuntimeWarning,
            stacklevel=3,
        )
        return None

    return torch.compiler.disable(hook)


def _post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # The callbacks first: closing the watch block judges what an unhooked step wrote, and a
    # finding there belongs to this step, not yet counted as completed.
    for callback in list(_after_step_callbacks):
        callback(optimizer)
    with _lock:
        _counts[optimizer] = _counts.get(optimizer, 0) + 1


def on_step(callback: Any) -> None:
    """Call ``callback(optimizer)`` after every optimizer step (the watch blocks end there)."""
    _after_step_callbacks.append(callback)


def keep(handle: Any) -> None:
    """A hook handle to remove at :func:`uninstall`."""
    _handles.append(handle)


def uninstall() -> None:
    while _handles:
        _handles.pop().remove()
    _after_step_callbacks.clear()


def install(policy: str | None) -> None:
    if _handles:
        return
    _handles.append(register_optimizer_step_pre_hook(_pre_step(policy)))
    _handles.append(register_optimizer_step_post_hook(torch.compiler.disable(_post_step)))
