"""The optimizer step as a phase of its own in watch's findings.

While any thread watches, torch's global optimizer step hooks tell the native session when
``optimizer.step()`` begins and ends in a watching thread: an op it runs outside every module
and autograd node is then born in phase ``"optimizer step"`` (csrc/locked/watch/watch_session.cpp).
A step of one of torch's own optimizers without a closure runs unhooked (issue 50: the per-op
hook and scans of AdamW's eight parameter-sized outputs per parameter were half of a watched
MiniLM step's extra time): its parameters, gradients and states get their first-sight scans
before it, and what it wrote is judged when it returns, per parameter, as the outputs of one op
(``cublas_guard_internal::optimizer_step_writes``) whose inputs are the gradient and the
parameter's tensors as they were before the step. So a birth there names the state, not which
of the update's ops made it; a closure (the model runs inside the step), a subclass and other
libraries' optimizers stay watched op by op.
When such a finding is raised (never per op), :func:`describe` reads the optimizer: its class and
step, which parameter's state went non-finite and which state (``exp_avg_sq``,
``momentum_buffer``, the parameter itself), the gradient's and the state's magnitudes, the
learning rate and this step's gradient norm; the losses passed to ``backward`` in watched blocks
(the last few, kept as detached tensors, read only here) give the history, or, where a
TrainingGuard drives this optimizer, the guard's own history of losses and gradient norms
(:func:`keep_history`: computed by the guard anyway, so watch adds no work for it). The lines
are written by errors/optimizer_step.py.
"""

from __future__ import annotations

import collections
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

_native = sys.modules[__package__ + ".session"]._native

_local = threading.local()
_HISTORY = 8
_handles: list[Any] = []
# Steps watched per optimizer (its step number when its state keeps none).
_counts: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


def _state() -> Any:
    st = _local
    if not hasattr(st, "stepping"):
        st.stepping = []  # optimizers whose step() runs now in this thread (innermost last)
        # Per step in `stepping`: None (watched op by op), else unhooked: the tensors it read
        # at its start, or True when it makes states (read again at its end).
        st.unhooked = []
        st.last = None  # weakref to the last optimizer that stepped here
        st.block = 0  # this thread's watch blocks begun (block_began)
        st.stepped = weakref.WeakKeyDictionary()  # optimizer -> the block of its last step
        st.models = []  # weakrefs to the watched models (parameter names)
    return st


# The last losses passed to backward while each model was watched (across blocks: run --watch
# opens one per step), detached, read only when a finding is raised.
_losses: weakref.WeakKeyDictionary[torch.nn.Module, collections.deque] = weakref.WeakKeyDictionary()


# Step histories kept by others, by optimizer: TrainingGuard's (step, loss, grad_norm) entries,
# read through a weak method (a strong one would keep the guard, and so the key, alive).
_histories: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.WeakMethod] = weakref.WeakKeyDictionary()


def keep_history(optimizer: torch.optim.Optimizer, read: Callable[[], list[dict[str, Any]]]) -> None:
    """``read()`` gives the recent steps of ``optimizer`` (dicts with ``loss`` and ``grad_norm``,
    floats or None, oldest first): a finding born in its step quotes them."""
    _histories[optimizer] = weakref.WeakMethod(read)  # type: ignore[arg-type]


def _kept_history(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    ref = _histories.get(optimizer)
    read = ref() if ref is not None else None
    if read is None:
        return []
    try:
        return list(read())
    except Exception:  # a message's extra lines never replace the finding
        return []


def _innermost_model() -> torch.nn.Module | None:
    for ref in reversed(_state().models):
        model = ref()
        if model is not None:
            return model
    return None


def _unhooked(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> bool:
    """Whether this step runs unhooked and is judged at its end: one of torch's own optimizers
    (they write only the parameters and ``optimizer.state``), called without a
    closure (LBFGS and a closure run the model inside the step: its ops stay hooked one by one,
    as do a subclass's or another library's optimizer, whose step may write anything)."""
    cls = type(optimizer)
    if not cls.__module__.startswith("torch.optim.") or cls.__name__ == "LBFGS":
        return False
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0]: the optimizer
    return closure is None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _dtensor_type() -> type | None:
    """DTensor's class where torch.distributed.tensor is imported (FSDP2 imports it), else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return module.DTensor if module is not None else None


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2's parameters, gradients and optimizer states), any
    other tensor as it is. torch runs a DTensor's ops on its local tensors below watch's
    dispatch key, so watch reads the shards itself: each rank judges what it holds, and never
    through a DTensor op, which may be a collective (a hang when one rank alone has a finding)."""
    dtensor = _dtensor_type()
    return t._local_tensor if dtensor is not None and isinstance(t, dtensor) else t


# Their update adds exp_avg / (a positive denominator) x step size to the parameter: a finite
# parameter after the step proves exp_avg finite, which is then not read (watch_device.cpp:
# step_writes_finite; tests/watch/test_watch_optimizer_unhooked.py, one test per class).
_FIRST_MOMENT_PROVEN = frozenset({"Adam", "AdamW", "NAdam", "RAdam", "Adamax"})
# Their exp_avg_sq is b2 * exp_avg_sq + (1 - b2) * grad * grad with the gradient p.grad itself
# where the group qualifies (_second_moment_provable): a bounded gradient and a bounded state
# keep it bounded, so it is not read (watch_device.cpp: second_moment_proven).
_SECOND_MOMENT_PROVEN = frozenset({"Adam", "AdamW", "NAdam", "RAdam"})


def _second_moment_provable(name: str, group: dict[str, Any]) -> bool:
    """Whether the step's exp_avg_sq update reads the raw gradient, b2 within [0, 1 - 1e-6]:
    no amsgrad (its max is another state), no weight decay added to the gradient (AdamW's and
    a decoupled one act on the parameter), not fused (a GradScaler's scale divides its gradient)
    nor differentiable."""
    if group.get("amsgrad") or group.get("fused") or group.get("differentiable"):
        return False
    if name != "AdamW" and group.get("weight_decay") and not group.get("decoupled_weight_decay"):
        return False
    try:
        beta2 = float(group["betas"][1])
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError):
        return False
    return 0.0 <= beta2 <= 1.0 - 1e-6


def _state_index(states: list[torch.Tensor], value: Any) -> int:
    return next((i for i, t in enumerate(states) if t is value), -1)


def _step_tensors(
    optimizer: torch.optim.Optimizer,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], int, int]], bool]:
    """(parameter, gradient, floating non-scalar state tensors, the index among them of the
    exp_avg a finite parameter proves finite or -1, that of the exp_avg_sq whose bound may be
    proven or -1) of each parameter that has a gradient (the others are skipped by torch's
    optimizers; a 0-dim ``step`` cannot overflow), DTensors as their local shards, and whether
    one of them has no state yet (its step makes it: read again at the end)."""
    out = []
    new_state = False
    state = optimizer.state
    dtensor = _dtensor_type()
    name = type(optimizer).__name__
    first_proven = name in _FIRST_MOMENT_PROVEN
    second_proven = name in _SECOND_MOMENT_PROVEN
    for group in optimizer.param_groups:
        second_in_group = second_proven and _second_moment_provable(name, group)
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            values = state.get(p)
            states = []
            first_moment = second_moment = -1
            if not values:
                new_state = True
            else:
                states = [
                    v
                    for v in values.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.is_floating_point()
                ]
                if first_proven:
                    first_moment = _state_index(states, values.get("exp_avg"))
                if second_in_group:
                    second_moment = _state_index(states, values.get("exp_avg_sq"))
            if dtensor is not None and isinstance(p, dtensor):
                p, g, states = p._local_tensor, local_shard(g), [local_shard(t) for t in states]
            out.append((p, g, states, first_moment, second_moment))
    return out, new_state


# What an unhooked step wrote and its end found finite (CPU tags, read on the host): per
# optimizer, the tensors' ids and their versions then. Until one of them is written (its version
# moves) or its optimizer steps unwatched, it needs no first-sight scan at the next block's step,
# nor at the block's entry check (run --watch opens a block per step: 180 MB of AdamW states and
# 90 MB of parameters a MiniLM step). A write behind torch's back (.data, a fused kernel outside
# watch: neither moves the version) is then seen only when an op or the next step's end reads it.
# Weak references (made once per tensor): a state replaced by load_state_dict is not kept alive.
# With them, the ids of the second moments the step's end left bounded (step_writes_finite): their
# bound holds at the next block's step as their finiteness does, by the same versions.
_judged: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[list[int], list[int], frozenset[int]]] = (
    weakref.WeakKeyDictionary()
)
_refs: dict[int, weakref.ref] = {}
_index: dict[int, tuple[list[int], int]] = {}  # id -> (versions, position), rebuilt when read
_bounded: set[int] = set()  # ids of the judged second moments with a bound, rebuilt with _index
_index_stale = [False]


def known_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` was found finite at the end of a watched step and not written since."""
    if _index_stale[0]:
        _index.clear()
        _bounded.clear()
        for ids, versions, bounded in list(_judged.values()):
            for k, i in enumerate(ids):
                _index[i] = (versions, k)
            _bounded.update(bounded)
        _index_stale[0] = False
    i = id(t)
    entry = _index.get(i)
    if entry is None:
        return False
    ref = _refs.get(i)
    return ref is not None and ref() is t and entry[0][entry[1]] == t._version


def known_bounded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a second moment whose bound a watched step's end proved, not written
    since (known_finite first: it rebuilds the index)."""
    return known_finite(t) and id(t) in _bounded


def _forget(optimizer: torch.optim.Optimizer) -> None:
    judged = _judged.pop(optimizer, None)
    if judged is not None:
        for i in judged[0]:
            _refs.pop(i, None)
        _index_stale[0] = True


def _remember(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor], bounded: frozenset[int]) -> None:
    ids = [id(t) for t in tensors]
    before = _judged.get(optimizer)
    if before is None or before[0] != ids:  # new tensors: their references, once
        for i in set(before[0] if before else ()).difference(ids):
            _refs.pop(i, None)
        for i, t in zip(ids, tensors):
            ref = _refs.get(i)
            if ref is None or ref() is not t:
                _refs[i] = weakref.ref(t)
    _judged[optimizer] = (ids, [t._version for t in tensors], bounded)
    _index_stale[0] = True


def block_began() -> None:
    """A watch block begins in this thread: its first step of each optimizer looks up what the
    last watched step found finite; later steps in the block find every tensor tagged."""
    _state().block += 1


def _pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _native._watch_active():
        if optimizer in _judged:
            _forget(optimizer)  # a step nobody judged: what it wrote is no longer known
        return
    st = _state()
    st.stepping.append(optimizer)
    st.last = weakref.ref(optimizer)
    tensors, new_state = _step_tensors(optimizer) if _unhooked(optimizer, args, kwargs) else (None, False)
    if tensors is None or not all(type(p) in _PLAIN and type(g) is torch.Tensor for p, g, *_ in tensors):
        # Op by op: a closure, another library's optimizer, or parameters that are tensor
        # subclasses other than DTensor (whose local shards _step_tensors reads).
        st.unhooked.append(None)
        _native._watch_optimizer_step(True)
        return
    st.unhooked.append(True if new_state else tensors)  # the end reads the same tensors
    scan = [t for p, g, states, *_ in tensors for t in (g, p, *states)]
    finite: list[torch.Tensor] = []
    bounded: list[torch.Tensor] = []
    if st.stepped.get(optimizer) != st.block:  # its first step in this block
        st.stepped[optimizer] = st.block
        finite = [t for t in scan if known_finite(t)]
        if finite:
            known = {id(t) for t in finite}
            scan = [t for t in scan if id(t) not in known]
            bounded = [t for t in finite if known_bounded(t)]
    _native._watch_optimizer_begin(scan, finite, bounded)


def _post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    st = _state()
    if st.stepping and st.stepping[-1] is optimizer:
        _finish(st)


def _finish(st: Any) -> None:
    """The innermost step of this thread has ended: judged now if it ran unhooked."""
    optimizer = st.stepping.pop()
    unhooked = st.unhooked.pop() if st.unhooked else None
    try:
        if unhooked is None:
            _native._watch_optimizer_step(False)
            return
        # With the states this step made, if it made any (True), else the tensors read at its
        # start. (read, written) per parameter: read is the gradient, then the parameter's
        # tensors as the step read them; the parameter is scanned last, so its scan sees its
        # states' tags from before the step.
        tensors = _step_tensors(optimizer)[0] if unhooked is True else unhooked
        groups = [([g, p, *states], [*states, p], first, second) for p, g, states, first, second in tensors]
        finite, bounded = False, []
        try:
            # A finding is raised here (mode sync) or at the next op: st.last names the optimizer.
            finite, bounded = _native._watch_optimizer_end(groups) or (False, [])
        finally:
            if finite:
                written = [t for _, written, _, _ in groups for t in written]
                _remember(optimizer, written, frozenset(id(groups[i][1][groups[i][3]]) for i in bounded))
            elif _judged:
                _forget(optimizer)
    finally:
        _counts[optimizer] = _counts.get(optimizer, 0) + 1


def block_ending() -> None:
    """A watch block ends while steps are open in this thread (``run --watch`` closes its block
    in an optimizer post hook, which may run before this module's): they are finished now, the
    unhooked ones judged while the block still watches."""
    st = _state()
    while st.stepping:
        _finish(st)


def install() -> None:
    """Called by global_patches.install. Installed once and kept: a post hook that ended the
    block (``run --watch`` closes it after each step) must not remove hooks while torch iterates
    them; outside a watch each hook is one check of a thread-local flag per step."""
    if not _handles:
        _handles.append(register_optimizer_step_pre_hook(torch.compiler.disable(_pre)))
        _handles.append(register_optimizer_step_post_hook(torch.compiler.disable(_post)))


def model_entered(model: torch.nn.Module | None) -> None:
    if model is not None:
        _state().models.append(weakref.ref(model))


def model_left(model: torch.nn.Module | None) -> None:
    models = _state().models
    for i in range(len(models) - 1, -1, -1):
        if models[i]() is model:
            del models[i]
            break


def loss_passed(roots: list[torch.Tensor]) -> None:
    """A root of backward: kept (detached, no host read) for the history of a later finding."""
    model = _innermost_model()
    if model is not None and len(roots) == 1 and roots[0].numel() == 1 and roots[0].is_floating_point():
        _losses.setdefault(model, collections.deque(maxlen=_HISTORY)).append(roots[0].detach())


def left_step() -> None:
    """A finding raised inside step() leaves it (the post hook will not run)."""
    st = _state()
    while st.stepping:
        st.stepping.pop()
        if st.unhooked and st.unhooked.pop() is not None:
            continue  # its end ended it natively (the finding is raised from there)
        _native._watch_optimizer_step(False)


def _names() -> dict[int, str]:
    names: dict[int, str] = {}
    for ref in _state().models:
        model = ref()
        if model is not None:
            for name, p in model.named_parameters():
                names.setdefault(id(p), name)
    return names


def _finite_absmax(t: torch.Tensor) -> tuple[float, int]:
    """(largest finite magnitude, how many values are not finite), in float64 on the host."""
    x = t.detach()
    x = x.coalesce().values() if x.is_sparse else x
    x = x.double()
    finite = torch.isfinite(x)
    bad = int((~finite).sum())
    absmax = (
        float(torch.where(finite, x.abs(), torch.zeros((), dtype=x.dtype, device=x.device)).max())
        if x.numel()
        else 0.0
    )
    return absmax, bad


def _candidates(optimizer: torch.optim.Optimizer) -> list[tuple[int, torch.Tensor, str, torch.Tensor]]:
    """(group index, parameter, state key, tensor) for every floating state and parameter."""
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                    out.append((gi, p, str(key), local_shard(value)))
            out.append((gi, p, "the parameter", local_shard(p)))
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        value = local_shard(value)
        return float(value.detach().double().cpu().reshape(-1)[0]) if value.numel() else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _step_number(optimizer: torch.optim.Optimizer, p: torch.Tensor | None) -> dict[str, Any]:
    """The step from the optimizer's own count (Adam's ``step`` state), else which step of
    those watched it is (an optimizer without a step count, such as SGD)."""
    number = _number(optimizer.state.get(p, {}).get("step")) if p is not None else None
    if number is not None and number >= 1:
        return {"optimizer_step": int(number)}
    return {"steps_watched": _counts.get(optimizer, 0) + 1}


_HYPER = ("betas", "eps", "weight_decay", "momentum", "nesterov", "foreach", "fused")


def describe(fields: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's part of a finding born in its step (empty when no optimizer is known)."""
    st = _state()
    optimizer = st.stepping[-1] if st.stepping else (st.last() if st.last is not None else None)
    if optimizer is None:
        return {}
    with torch.no_grad():
        return _describe(optimizer, fields, st)


def _describe(optimizer: torch.optim.Optimizer, fields: dict[str, Any], st: Any) -> dict[str, Any]:
    names = _names()
    out: dict[str, Any] = {"optimizer": type(optimizer).__name__}
    shape = list(fields.get("shape") or [])
    bad = []
    for gi, p, key, value in _candidates(optimizer):
        if not bool(torch.isfinite(value.detach()).all()):
            bad.append((gi, p, key, value))
    # The finding's own tensor: the first non-finite one of the output's shape (the op just
    # wrote it; a foreach op wrote several, listed as also non-finite).
    chosen = next((b for b in bad if list(b[3].shape) == shape), bad[0] if bad else None)
    model = _innermost_model()
    kept = _kept_history(optimizer)
    if kept:  # the TrainingGuard's: every step's loss and gradient norm, watched or not
        out["loss_history"] = [e["loss"] for e in kept if e.get("loss") is not None] or None
        out["grad_norm_history"] = [e["grad_norm"] for e in kept if e.get("grad_norm") is not None] or None
    else:
        losses = [_number(v) for v in list(_losses.get(model, ()))] if model is not None else []
        out["loss_history"] = [v for v in losses if v is not None] or None
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if grads:
        norms = torch.stack([torch.linalg.vector_norm(local_shard(g).detach().double()).cpu() for g in grads])
        out["grad_norm"] = float(torch.linalg.vector_norm(norms))
        out["grad_norm_local"] = any(local_shard(g) is not g for g in grads) or None  # DTensor shards
    if chosen is None:
        group = optimizer.param_groups[0]
        out["lr"] = _number(group.get("lr"))
        out.update(_step_number(optimizer, None))
        return out
    gi, p, key, value = chosen
    group = optimizer.param_groups[gi]
    name = names.get(id(p), f"<parameter {tuple(p.shape)} of param group {gi}>")
    absmax, n_bad = _finite_absmax(value)
    nan = int(torch.isnan(value.detach()).sum())
    out.update(_step_number(optimizer, p))
    out.update(
        parameter=name,
        state=key,
        state_dtype=str(value.dtype).replace("torch.", ""),
        state_nonfinite=(nan, n_bad - nan),
        state_absmax=absmax,
        lr=_number(group.get("lr")),
        hyper={k: group[k] for k in _HYPER if k in group and group[k] is not None},
    )
    if p.grad is not None:
        out["grad_absmax"], out["grad_nonfinite"] = _finite_absmax(p.grad)
    out["also_bad"] = [
        f"{'the parameter' if k == 'the parameter' else k} of '{names.get(id(q), tuple(q.shape))}'"
        for _, q, k, v in bad
        if v is not value
    ] or None
    return out
