"""A bad step's replay (TrainingGuard's, moved out of guard.py to keep it under 600 lines):
the closure runs again from the same RNG states and buffers under ``watch`` (a compiled
model eagerly), with no collective inside; what it found, as plain values that cross ranks.

With ``sample_ids`` the replay also records, module by module, which rows of the batch hold
the first non-finite values (:mod:`.samples`), so the step's error names its culprit samples.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import NonFiniteEntryError, NonFiniteInputError, NonFiniteOutputError
from . import samples as _samples
from .state import (
    _bad_flag,
    _eager_if,
    _fsdp_local,
    _fsdp_modules,
    _is_ddp,
    _replay_note,
    _replay_watch,
    _wrappers,
)

# What a guarded layer (SafeLinear's checks) or a watch block of the user's raises about a
# NaN/Inf inside the closure: the step is non-finite, handled like a non-finite loss. Every
# other error (a wrong shape, a cuBLAS failure) is a bug, not a bad step, and propagates.
NON_FINITE_REFUSALS: tuple[type[BaseException], ...] = (
    NonFiniteInputError,
    NonFiniteOutputError,
    NonFiniteEntryError,
)


def run(guard: Any, closure: Callable[[], Any], rng: Any) -> dict[str, Any]:
    """Run the closure again from the same RNG and buffers, under watch; what it found."""
    out: dict[str, Any] = dict.fromkeys(("finding", "op", "module", "phase", "exception", "note"), None)
    out["reproduced"] = False
    out["samples"] = None
    compiled = any(getattr(m, "_orig_mod", None) is not None for m in _wrappers(guard.model))
    # watch judges a NaN by what it reaches, raising when it reaches the model's output; under
    # FSDP2 that raise lands after FSDP's post-forward hook and leaves its forward/backward
    # bookkeeping half-run, and the ranks' next collectives no longer pair up (a hang). There
    # the replay reports at birth instead: the step's loss or gradients already showed the NaN
    # mattered, so the first birth is the producer unless the model also makes harmless
    # infinities on purpose (T5's log(0)), which only the consequence rule can tell apart.
    report = "birth" if guard.group is not None and _fsdp_modules(guard.inner) else "consequence"
    batch = guard.batch
    ids = batch.ids if batch is not None else None
    capture = _samples.BatchCapture(guard.model, batch.given) if ids is not None else None
    rows = _samples.RowRecorder(guard.inner, capture) if capture is not None else None
    guard.restore(rng)  # (the gradients are None already: the bad step set them so)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(replay_context(guard))
            stack.enter_context(_eager_if(compiled))
            stack.enter_context(warnings.catch_warnings())
            # (watch's global module hooks around a compiled module: fine here, they name
            # the inner modules only)
            warnings.filterwarnings(
                "ignore", message=r"Using `torch.compile\(module\)` when there are global hooks"
            )
            if capture is not None and rows is not None:
                stack.enter_context(capture)
                stack.enter_context(rows)
            with _replay_watch(guard.inner, guard.allow, report):
                replay_loss = closure()
            flag = _bad_flag(replay_loss, replay_grads(guard), guard.scaler is None)  # (outside the watch)
        out["reproduced"] = bool(flag is not None and flag.item())
        if out["reproduced"]:
            out["note"] = _replay_note()
    except NON_FINITE_REFUSALS as finding:
        out.update(finding=str(finding), reproduced=True, exception=finding)
        f = getattr(finding, "fields", {})
        if isinstance(finding, NonFiniteOutputError):
            out.update(op=f.get("op"), module=f.get("module"), phase=f.get("phase", "forward"))
            out.update(overflow=f.get("overflow"), dtype=f.get("dtype"))  # (the overflow's next steps)
            out["coords"] = (f.get("first_bad_coords"), f.get("shape"))
        elif isinstance(finding, NonFiniteEntryError):
            out.update(phase="entry", module=f.get("name"))
        else:  # a guarded layer refused a value in the replay as well
            backward = f.get("role") == "grad_output" or f.get("pass") == "backward"
            out.update(
                op="cublas_guard::linear",
                module=f.get("layer"),
                phase="backward" if backward else "forward",
            )
    if capture is not None and rows is not None and ids is not None:
        coords = out.pop("coords", None)
        out["samples"] = _samples.culprits(ids, capture, rows, out["module"], out["phase"], coords)
    out.pop("coords", None)
    if compiled and not out["reproduced"]:
        # eager found nothing: does the compiled code reproduce it?
        guard.restore(rng)
        with replay_context(guard):
            replay_loss = closure()
            flag = _bad_flag(replay_loss, replay_grads(guard), guard.scaler is None)
        if flag is not None and flag.item():
            out.update(
                reproduced=True,
                note="reproduces only as compiled: the eager replay under "
                "watch is finite, the compiled one is not (a compiler numerics difference?)",
            )
    return out


def replay_grads(guard: Any) -> list[torch.Tensor]:
    """The replay's gradients: the module's parameters as they are now (under FSDP2's replay,
    the gathered ones, which hold the local gradients)."""
    return [p.grad for p in guard.inner.parameters() if p.grad is not None]


@contextlib.contextmanager
def replay_context(guard: Any) -> Iterator[None]:
    """No collective inside the replay: DDP's gradient all-reduce off; FSDP2's parameters
    gathered first (all ranks, in step) and its gradient reduction off."""
    with contextlib.ExitStack() as stack:
        for m in _wrappers(guard.model):
            if _is_ddp(m):
                stack.enter_context(m.no_sync())
        fsdp = _fsdp_modules(guard.inner) if guard.group is not None else []
        if fsdp:
            stack.enter_context(_fsdp_local(fsdp))
        yield


def place_transient(
    guard: Any, closure: Callable[[], Any], rng: Any, out: dict[str, Any], refusal: Any, record: Any
) -> None:
    """A bad step whose replay is finite (transient): place it with what the faulty run left.
    A watch session around the faulty run raised at the birth: that op, module and phase. A
    recorded run (a checked step of ``SilentCorruptionChecks(check_every=N)``): one more rerun,
    recorded the same way; the first module and phase where the two records differ."""
    if isinstance(refusal, NonFiniteOutputError):
        f = refusal.fields
        out.update(
            op=f.get("op"), module=f.get("module"), phase=f.get("phase") or "forward", placed_by="watch"
        )
        return
    if record is None:
        return
    from .run_signatures import Record, Recorder, compare

    rerun = Record()
    guard.restore(rng)
    with replay_context(guard), Recorder(guard.inner, rerun):
        closure()
    index, _ = compare(record, rerun, None)
    keys = record.keys if index is not None and index < len(record.keys) else rerun.keys
    if index is None or index >= len(keys):
        return
    module, phase, what, _ = keys[index]
    out.update(module=module, phase=phase, what=what, placed_by="record")
