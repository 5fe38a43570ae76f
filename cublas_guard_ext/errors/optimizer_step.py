"""A NaN/Inf born in ``optimizer.step()``: the lines of watch's finding (errors/watch_findings.py).

The numbers come from cublas_guard_ext/watching/optimizer_step.py, read when the finding is
raised (never per op): the optimizer's class and step, the parameter by name, the state the
value went into (``exp_avg_sq``, ``momentum_buffer``, the parameter itself), the gradient's and
the state's magnitudes, the learning rate, the recent losses and this step's gradient norm.
Plain numbers here: the errors layer imports no torch.

Fields (None when not known): ``optimizer`` (class name), ``optimizer_step`` (its own count:
Adam's ``step``), ``steps_watched`` (else: which step of those watched in this process), ``parameter``,
``state`` (the state's key, or ``"the parameter"``), ``state_dtype``, ``state_nonfinite``
(NaN and Inf now in that state), ``state_absmax`` (its largest finite magnitude now),
``grad_absmax`` (the parameter's gradient's largest finite magnitude), ``grad_nonfinite``,
``grad_norm`` (all the optimizer's gradients, float64), ``lr``, ``hyper`` (the group's other
settings), ``also_bad`` (other parameter/state pairs non-finite now), ``loss_history`` (the
last losses passed to backward in watched blocks, or a TrainingGuard's, oldest first),
``grad_norm_history`` (the TrainingGuard's gradient norms of its last steps, oldest first).
"""

from __future__ import annotations

import math
from typing import Any

from .magnitudes import format_max, format_number, range_note

OPTIMIZER_FIELDS = (
    "optimizer", "optimizer_step", "steps_watched", "parameter", "state", "state_dtype", "state_nonfinite", "state_absmax",
    "grad_absmax", "grad_nonfinite", "grad_norm", "grad_norm_local", "lr", "hyper", "also_bad", "loss_history",
    "grad_norm_history",
)  # fmt: skip

# The op name of an unhooked step's writes (csrc/locked/watch/watch_python.cpp): torch's own
# optimizers run without a hook per op, and what the step wrote is judged when it returns.
STEP_WRITES_OP = "cublas_guard_internal.optimizer_step_writes.default"

# States that accumulate the gradient squared: grad**2 past the dtype's largest value is Inf.
_SQUARED_STATES = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_inf")
# Optimizers whose usual learning rates are small (adaptive steps of about lr per element).
_ADAPTIVE = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adafactor", "RMSprop", "Adagrad", "Adadelta")


def _n(value: Any) -> str:
    return "?" if value is None else format_number(float(value))


def _state_text(f: dict[str, Any]) -> str:
    state = f.get("state")
    if state is None or state == "the parameter":
        return f"the parameter '{f.get('parameter')}'"
    return f"{state} of parameter '{f.get('parameter')}'"


def headline(f: dict[str, Any], counts: str) -> str:
    step = f", step {f['optimizer_step']}" if f.get("optimizer_step") is not None else ""
    if not step and f.get("steps_watched") is not None:
        step = f", step {f['steps_watched']} of those watched"
    into = f" into {_state_text(f)}" if f.get("parameter") is not None else ""
    op = "" if f.get("op") == STEP_WRITES_OP else f", {f.get('op')}"
    return (
        f"watch: {f.get('optimizer') or 'the optimizer'}.step() (optimizer step{step}{op}) "
        f"produced {counts}{into} from finite inputs"
    )


def judged_at_return(f: dict[str, Any]) -> str | None:
    """The line that says how an unhooked step was judged (None for a step watched op by op)."""
    if f.get("op") != STEP_WRITES_OP:
        return None
    return (
        f"judged when step() returned: {_state_text(f)} was finite before the step and its gradient "
        "finite (the step's own ops run unhooked, one check of what it wrote: docs/watch.md)"
    )


def reached(f: dict[str, Any]) -> str | None:
    """What the value reached, named as the optimizer's state rather than 'a tensor written'."""
    if f.get("parameter") is None:
        return None
    if f.get("state") == "the parameter":
        return f"the parameter '{f['parameter']}', written by {f.get('optimizer')}.step()"
    return f"{f.get('optimizer')}'s state {f.get('state')} of parameter '{f['parameter']}'"


def _overflow_note(f: dict[str, Any]) -> str | None:
    fmt = format_max(f.get("state_dtype"))
    grad = f.get("grad_absmax")
    if fmt is None or grad is None:
        return None
    label, largest = fmt
    if f.get("state") in _SQUARED_STATES and grad * grad > largest:
        return (
            f"{_n(grad)} squared is {_n(grad * grad)}, past the {label} range {_n(largest)}: "
            f"{f.get('state')} accumulates grad * grad, so it overflowed to +Inf"
        )
    return range_note(f.get("state_dtype"), grad)


def details(f: dict[str, Any]) -> list[str]:
    lines = []
    if f.get("parameter") is not None:
        nan, inf = f.get("state_nonfinite") or (None, None)
        lines.append(
            f"the state: {_state_text(f)} ({f.get('state_dtype')}) holds {nan} NaN and {inf} Inf now; "
            f"its largest finite magnitude {_n(f.get('state_absmax'))}"
        )
    if f.get("grad_absmax") is not None:
        line = f"the gradient of '{f.get('parameter')}': largest magnitude {_n(f['grad_absmax'])}"
        if f.get("grad_nonfinite"):
            line += f" ({f['grad_nonfinite']} of its values non-finite)"
        note = _overflow_note(f)
        lines.append(line + (f" ({note})" if note else ""))
    if f.get("also_bad"):
        more = list(f["also_bad"])
        lines.append(
            "also non-finite now: "
            + ", ".join(more[:6])
            + (f" and {len(more) - 6} more" if len(more) > 6 else "")
        )
    settings = [f"lr {_n(f.get('lr'))}"] if f.get("lr") is not None else []
    settings += [f"{k} {v}" for k, v in (f.get("hyper") or {}).items()]
    if settings:
        lines.append(f"{f.get('optimizer') or 'optimizer'} settings: " + ", ".join(settings))
    if f.get("grad_norm") is not None:
        scope = (
            "this rank's shards of the optimizer's parameters"
            if f.get("grad_norm_local")
            else ("all the optimizer's parameters")
        )
        lines.append(f"gradient norm this step ({scope}): {_n(f['grad_norm'])}")
    history = f.get("loss_history")
    norms = f.get("grad_norm_history")
    if history:
        source = "TrainingGuard's steps" if norms else "passed to backward"
        lines.append(f"recent losses ({source}, oldest first): " + ", ".join(_n(v) for v in history))
    if norms:
        lines.append(
            "recent gradient norms (TrainingGuard's steps, oldest first): " + ", ".join(_n(v) for v in norms)
        )
    return lines


def _growth(history: list[float] | None) -> float | None:
    if not history or len(history) < 2:
        return None
    first, last = history[0], history[-1]
    if not (math.isfinite(first) and first > 0) or not math.isfinite(last):
        return None
    return last / first


def next_steps(f: dict[str, Any]) -> list[str]:
    steps = []
    norm = f.get("grad_norm")
    clip = "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0) after backward, before step()"
    steps.append(
        f"clip the gradients: {clip}" + (f" (this step's norm was {_n(norm)})" if norm is not None else "")
    )
    lr = f.get("lr")
    if lr is not None and lr > 0:
        name = str(f.get("optimizer") or "")
        if name in _ADAPTIVE and lr > 1e-2:
            steps.append(
                f"lower the learning rate: lr={lr:g} is far above {name}'s usual 1e-4 to 1e-3 "
                "(try lr=3e-4, with a warmup)"
            )
        else:
            steps.append(
                f"lower the learning rate: lr={lr:g} now; try lr={lr / 10:g} (10x lower), with a warmup"
            )
    growth = _growth(f.get("loss_history"))
    if growth is not None and growth > 10:
        history = f["loss_history"]
        steps.append(
            f"the run diverged before the first Inf (the loss grew {_n(growth)}x over the last "
            f"{len(history) - 1} steps, {_n(history[0])} to {_n(history[-1])}): restart from a checkpoint "
            "saved before it grew"
        )
    return steps
