"""The pieces of a guarded training step that hold no policy (see :mod:`cublas_guard_ext.training`):
what a step keeps to be undone (RNG states, buffers), the fused finite check, the steps' history
and the process group as the guard's collaborators use them (:class:`StepHistory`,
:class:`Collective`), how to reach the module inside DDP / torch.compile wrappers, and FSDP2 set
up for a replay without collectives. A module of its own so that guard.py stays under ~600 lines.
"""

from __future__ import annotations

import collections
import contextlib
import math
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ..watching.session import AVAILABLE as _WATCH_AVAILABLE
from ..watching.session import watch


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module that holds the parameters under DDP / torch.compile wrappers."""
    *_, inner = _wrappers(model)  # the innermost
    return inner


def _is_ddp(model: Any) -> bool:
    parallel = sys.modules.get("torch.nn.parallel")
    ddp = getattr(parallel, "DistributedDataParallel", None)
    return ddp is not None and isinstance(model, ddp)


def _wrappers(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` and each module inside its torch.compile / DDP wrappers, outermost first."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        yield model
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, torch.nn.Module):
            model = inner
        elif _is_ddp(model):
            model = model.module


def _fsdp_modules(model: torch.nn.Module) -> list[Any]:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FSDPModule", None)
    return [m for m in model.modules() if cls is not None and isinstance(m, cls)]


class _RngState:
    """CPU, every initialised CUDA device, Python's random and NumPy's global generator."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.python = random.getstate()
        np = sys.modules.get("numpy")
        self.numpy = np.random.get_state() if np is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


class _Buffers:
    """A copy of every buffer of the model, taken before each step.

    Every buffer, every step: BatchNorm's running statistics are written inside the
    batch_norm kernel without bumping the tensor's version counter, so a version check
    cannot tell which buffers a forward changed (the tests caught exactly that). Buffers are
    small next to the parameters (MiniLM: 8 KB); a step copies them once."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.kept: list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]] = []

    def snapshot(self) -> None:
        self.kept = [
            (module, name, buf, buf.detach().clone())
            for module in self.model.modules()
            for name, buf in module._buffers.items()
            if buf is not None
        ]

    @torch.no_grad()
    def restore(self) -> None:
        for module, name, buf, copy in self.kept:
            if module._buffers.get(name) is not buf:
                module._buffers[name] = buf
            buf.copy_(copy)


def _bad_flag(loss: Any, grads: list[torch.Tensor], check_grads: bool) -> torch.Tensor | None:
    """One float32 tensor: 1.0 if the loss or any gradient holds NaN/Inf, else 0.0. No host sync.

    The gradients go through GradScaler's own fused check,
    ``torch._amp_foreach_non_finite_check_and_unscale_`` with an inverse scale of 1 (the values
    are written back unchanged): one multi-tensor kernel per device and dtype on CUDA, an exact
    isfinite test (no norm that could overflow). On the CPU it is also the fastest pass found:
    4.7 ms for MiniLM's 22.7M gradients on one thread, against 5.0 ms for _foreach_norm(2),
    60 ms for _foreach_norm(inf) and 79 ms for per-tensor isfinite().all()."""
    found: list[torch.Tensor] = []
    if check_grads:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            if hasattr(g, "to_local"):  # a DTensor (FSDP2): this rank's shard; the all-reduce joins them
                g = g.to_local()
            if g.is_sparse:
                g = g.coalesce().values()
            if g.numel():
                groups.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), ts in groups.items():
            flag = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(ts, flag, torch.ones(1, device=device))
            found.append(flag)
    if isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel():
        found.append((~torch.isfinite(loss.detach())).any().float().reshape(1))
    elif isinstance(loss, float):
        found.append(torch.tensor([0.0 if math.isfinite(loss) else 1.0]))
    if not found:
        return None
    if len(found) == 1:
        return found[0].reshape(())
    device = found[0].device
    return torch.cat([f.to(device, non_blocking=True) for f in found]).max()


def _grad_norm(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The global 2-norm of ``grads`` as a float32 0-d tensor (NaN/Inf when they hold one), or
    None without gradients. No host sync: one ``_foreach_norm`` per device and dtype (computed
    in float32, so float16 gradients do not overflow the norm) and a few small kernels."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if hasattr(g, "to_local"):
            g = g.to_local()
        if g.is_sparse:
            g = g.coalesce().values()
        if g.numel():
            groups.setdefault((g.device, g.dtype), []).append(g)
    if not groups:
        return None
    norms = [n.reshape(1) for ts in groups.values() for n in torch._foreach_norm(ts, 2, dtype=torch.float32)]
    device = norms[0].device
    return torch.linalg.vector_norm(torch.cat([n.to(device, non_blocking=True) for n in norms]))


class StepHistory:
    """The last ``size`` steps (``guard.history``): step number, loss and gradient norm as kept
    (tensors, read only when a message needs them: no host sync on a healthy step), skipped,
    refused by. The messages of the guard's errors and ``state_dict`` read it."""

    def __init__(self, size: int) -> None:
        self.entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=max(size, 0))

    def add(self, step: int, loss: Any, grad_norm: torch.Tensor | None) -> None:
        if self.entries.maxlen:
            if isinstance(loss, torch.Tensor):
                loss = loss.detach() if loss.numel() == 1 else None
            self.entries.append(
                {"step": step, "loss": loss, "grad_norm": grad_norm, "skipped": False, "refused_by": None}
            )

    def mark(self, step: int, **changes: Any) -> None:
        """Mark the entry of ``step`` (skipped=True, refused_by=...), adding it if missing."""
        if not self.entries.maxlen:
            return
        for entry in self.entries:
            if entry["step"] == step:
                entry.update(changes)
                return
        self.add(step, None, None)
        self.entries[-1].update(changes)

    def grad_norm(self, step: int) -> torch.Tensor | None:
        """The gradient norm noted for ``step`` when it is the latest entry (a device tensor,
        not read), else None."""
        if self.entries and self.entries[-1]["step"] == step:
            return self.entries[-1]["grad_norm"]
        return None

    def read(self) -> list[dict[str, Any]]:
        """The entries with plain floats (a host read per tensor: only for a message)."""

        def value(v: Any) -> float | None:
            if isinstance(v, torch.Tensor):
                return float(v.float().item())
            return float(v) if isinstance(v, (int, float)) else None

        return [{**e, "loss": value(e["loss"]), "grad_norm": value(e["grad_norm"])} for e in self.entries]

    def load(self, entries: list[dict[str, Any]]) -> None:
        """Replace the entries by ``entries`` (what :meth:`read` gave), the last ``size`` kept."""
        self.entries.clear()
        if self.entries.maxlen:
            self.entries.extend(entries[-self.entries.maxlen :])


class Collective:
    """The guard's process group as its collaborators use it (``guard.collective``). Every rank
    calls :meth:`agree` and :meth:`gather` together and in the same order; without a group (one
    process) both are local and ``rank`` and ``world`` are None."""

    def __init__(self, group: Any) -> None:
        self.group = group

    @property
    def rank(self) -> int | None:
        """This process's rank in the group (None without one)."""
        if self.group is None:
            return None
        import torch.distributed as dist

        return dist.get_rank(self.group)

    @property
    def world(self) -> int | None:
        """The group's size (None without one)."""
        if self.group is None:
            return None
        import torch.distributed as dist

        return dist.get_world_size(self.group)

    def agree(self, flag: torch.Tensor) -> torch.Tensor:
        """``flag``'s MAX over the ranks (an all-reduce, no host read; a gloo group reduces a CPU
        copy of a device tensor): the tensor to read, ``flag`` itself when not copied."""
        if self.group is None:
            return flag
        import torch.distributed as dist

        if dist.get_backend(self.group) == "gloo" and flag.device.type != "cpu":
            flag = flag.cpu()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag

    def gather(self, item: Any) -> list[Any]:
        """Every rank's ``item`` (any picklable value), in rank order: ``[item]`` without a group."""
        if self.group is None:
            return [item]
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, item, group=self.group)
        return out


def _param_absmax(model: torch.nn.Module) -> tuple[float | None, str | None, str | None]:
    """The parameters' largest finite absolute value, the parameter's name and dtype."""
    best: tuple[float | None, str | None, str | None] = (None, None, None)
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            if not t.is_floating_point() or not t.numel():
                continue
            finite = t.detach().abs().nan_to_num(nan=0.0, posinf=0.0)
            value = float(finite.max().float().item())
            if best[0] is None or value > best[0]:
                best = (value, name, str(t.dtype))
    return best


def _loss_value(loss: Any) -> float | None:
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach().float().item())
    if isinstance(loss, (int, float)):
        return float(loss)
    return None


def _refusal_layer(refusal: BaseException) -> str | None:
    """The guarded layer (or module) a refusal names."""
    f = getattr(refusal, "fields", {})
    return f.get("layer") or f.get("module") or f.get("name")


def _refusal_fields(refusal: BaseException) -> dict[str, Any]:
    """The refusal's fields a step's message uses (plain values: they cross ranks)."""
    f = getattr(refusal, "fields", {})
    keys = ("role", "nan_count", "posinf_count", "neginf_count", "zero_count", "op", "phase", "dtype")
    return {"error": type(refusal).__name__, **{k: f[k] for k in keys if f.get(k) is not None}}


def _default_group() -> Any:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist.group.WORLD


@contextlib.contextmanager
def _eager_if(compiled: bool) -> Iterator[None]:
    if compiled:
        with torch.compiler.set_stance("force_eager"):
            yield
    else:
        yield


# FSDP2 settings a replay changes, as attributes of its param groups / states (the names have
# moved between torch versions: whichever exist are saved and put back).
_FSDP_GROUP_ATTRS = (
    "reduce_grads",
    "all_reduce_grads",
    "reshard_after_backward",
    "post_forward_mesh_info",
    "_reshard_after_forward",
    "_use_post_forward_mesh",
)
_FSDP_STATE_ATTRS = ("_auto_reshard_after_forward",)


@contextlib.contextmanager
def _fsdp_local(modules: list[Any]) -> Iterator[None]:
    """FSDP2 for a replay without collectives: gather every parameter now (a collective all
    ranks take together), keep them gathered through forward and backward, accumulate the
    gradients unsharded and locally; afterwards drop those gradients, reshard, and put FSDP's
    settings back as they were."""
    states = [m._get_fsdp_state() for m in modules]
    groups = [g for st in states for g in getattr(st, "_fsdp_param_groups", [])]
    saved = [
        (obj, {a: v for a, v in vars(obj).items() if a in attrs})  # plain attributes, not properties
        for objs, attrs in ((groups, _FSDP_GROUP_ATTRS), (states, _FSDP_STATE_ATTRS))
        for obj in objs
    ]
    for m in modules:  # the public setters, whatever they set inside
        m.set_requires_gradient_sync(False, recurse=False)
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
    try:
        handles = [m.unshard(async_op=True) for m in modules]
        for h in handles:
            if h is not None:
                h.wait()
        yield
    finally:
        for obj, values in saved:
            for a, v in values.items():
                setattr(obj, a, v)
        for g in groups:
            for fp in getattr(g, "fsdp_params", []):
                if getattr(fp, "unsharded_accumulated_grad", None) is not None:
                    fp.unsharded_accumulated_grad = None
                if hasattr(fp, "_unsharded_param"):
                    fp.unsharded_param.grad = None
        for m in modules:
            m.reshard()


def _replay_watch(model: torch.nn.Module, allow: Any, report: str) -> Any:
    """The replay's watch block; under the stable core alone (watch needs the version-locked
    library) the replay runs unwatched and its note says so."""
    if not _WATCH_AVAILABLE:
        return contextlib.nullcontext()
    return watch(model, mode="sync", allow=allow, report=report)


def _replay_note() -> str:
    """Why a replay that is non-finite again names no producer."""
    if _WATCH_AVAILABLE:
        return "the replay under watch is non-finite again, but watch named no producer"
    return (
        "the replay is non-finite again; it ran without watch, which needs the version-locked "
        "library (`python -m cublas_guard_ext build`), so no op is named"
    )
