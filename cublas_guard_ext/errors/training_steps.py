"""The errors of a guarded training step (:class:`cublas_guard_ext.TrainingGuard`): one bad
step (:class:`NonFiniteStepError`) and a run that keeps making bad ones
(:class:`TrainingDivergedError`). Written from plain numbers (no torch import), like every
message of this package; the magnitudes' wording comes from :mod:`.magnitudes`.
"""

from __future__ import annotations

import math
from typing import Any

from .base import GuardError
from .magnitudes import counts_line, format_number, range_note
from .overflow import narrow_format, next_steps
from .samples import samples_line


def _fmt_loss(value: Any) -> str:
    if value is None:
        return "none returned"
    return format_number(value) if isinstance(value, float) else str(value)


def _history_lines(history: list[dict[str, Any]] | None) -> list[str]:
    """'recent steps (loss, gradient norm):' and one line per step, oldest first."""
    if not history:
        return []
    lines = ["recent steps (loss, gradient norm):"]
    for h in history:
        if h.get("refused_by"):
            text = f"refused by layer {h['refused_by']!r} before a loss was computed"
        else:
            loss = "none returned" if h.get("loss") is None else format_number(h["loss"])
            norm = "-" if h.get("grad_norm") is None else format_number(h["grad_norm"])
            text = f"loss {loss}, gradient norm {norm}"
        lines.append(f"  step {h.get('step')}: {text}{' (skipped)' if h.get('skipped') else ''}")
    return lines


class NonFiniteStepError(GuardError, ValueError):
    """A training step whose loss or gradients were NaN/Inf, or in which a guarded layer refused
    a non-finite value; no optimizer step was taken.

    Fields: ``step`` (1-based count of ``guard.step`` calls), ``loss`` (the bad step's loss as a
    float, None if the closure returned none or was interrupted), ``module``, ``op``, ``phase``
    (from the replay's finding; None when the replay named nothing), ``classification``
    (``"persistent"``: the replay is non-finite again; ``"transient"``: it is finite), ``rank``
    (the rank whose replay found it, or whose step was bad; None outside distributed runs),
    ``world_size`` (None outside distributed runs), ``bad_gradients`` (names of the parameters whose gradients were non-finite,
    at most 8), ``bad_gradient_count``, ``finding`` (the replay's message), ``note``,
    ``refused_by`` (the guarded layer whose check raised inside the step, its error being the
    ``__cause__``; None otherwise), ``refusal`` (that error's class name, role and counts, as a
    dict; None otherwise), ``history`` (the last steps: dicts with ``step``, ``loss``,
    ``grad_norm``, ``skipped``, ``refused_by``; oldest first), ``deferred`` (True when a
    ``TrainingGuard(deferred=True)`` read the step's check after the step; absent otherwise),
    ``overflow`` and ``dtype`` (when the replay's finding was an overflow of that dtype,
    errors/overflow.py: the next steps are then the overflow's; absent otherwise), ``samples``
    (with ``guard.step(..., sample_ids=)``: a dict with ``ids`` and ``rows`` of the culprit
    samples, ``batch`` (rows), ``where`` they were found, ``mapped``, ``note``, and with a skip
    list ``skip_list`` (its path) and ``listed``; absent without ids), ``placed_by`` and
    ``what`` (a transient step placed by what its faulty run left: ``"watch"``, a watch session
    around it saw the birth, ``module``/``op``/``phase`` are that birth's; ``"record"``, a
    checked step's record first differs from its rerun's at ``module``/``phase``/``what``;
    absent otherwise).
    """

    kind = "non_finite_step"

    def _headline(self) -> str:
        f = self.fields
        what = []
        if f.get("refused_by"):
            counts = counts_line(f.get("refusal") or {})
            role = (f.get("refusal") or {}).get("role", "input")
            what.append(
                f"layer {f['refused_by']!r} refused a non-finite {role}" + (f" ({counts})" if counts else "")
            )
        loss = f.get("loss")
        if isinstance(loss, float) and not math.isfinite(loss):
            what.append(f"loss {loss}")
        if f.get("bad_gradient_count"):
            what.append(f"non-finite gradients in {f['bad_gradient_count']} parameters")
        if not what:
            what.append("non-finite loss or gradients")
        return f"training step {f.get('step')}: {', '.join(what)}; no optimizer step was taken"

    def _finding_lines(self) -> list[str]:
        f = self.fields
        lines = []
        if f.get("placed_by") and f.get("classification") == "transient":
            by = (
                "the watch session around the faulty run saw its birth there"
                if f["placed_by"] == "watch"
                else "the faulty run was recorded module by module (a checked step): it first "
                "differs from its rerun there"
            )
            what = f.get("op") or f.get("what")
            lines.append(f"placed: {what} in module '{f.get('module')}' ({f.get('phase')}): {by}")
        elif f.get("op"):
            module = f.get("module")
            where = f"in module '{module}'" if module else "outside the model's modules (the loss, say)"
            lines.append(f"replayed under watch: {f['op']} {where} ({f.get('phase')}) produced it")
        elif f.get("phase") == "entry":
            lines.append(f"replayed under watch: {(f.get('finding') or '').splitlines()[0]}")
        if f.get("classification") == "persistent":
            lines.append("persistent: the replay (same batch, same RNG states) is non-finite again")
        else:
            lines.append(
                "transient: the replay (same batch, same RNG states) is finite; a one-off "
                "(hardware, a race, a non-deterministic kernel, state outside the model)"
            )
        if f.get("deferred"):
            lines.append(
                f"deferred: step {f.get('step')}'s check was read after the step (TrainingGuard("
                "deferred=True)); the fused optimizer had skipped its update on the device"
            )
        if f.get("finding") and f.get("phase") != "entry":
            lines.append("finding: " + f["finding"].splitlines()[0])
        samples = f.get("samples")
        if samples is not None:
            lines.append(samples_line(samples))
            if samples.get("listed"):
                lines.append(
                    f"skip list: added to {samples['skip_list']}; later batches holding them are skipped"
                )
            elif samples.get("skip_list") and f.get("classification") == "persistent":
                lines.append(
                    f"skip list: not added to {samples['skip_list']} (no culprit told apart from the batch)"
                )
        if f.get("bad_gradients"):
            more = f["bad_gradient_count"] - len(f["bad_gradients"])
            lines.append(
                "non-finite gradients: "
                + ", ".join(f["bad_gradients"])
                + (f" and {more} more" if more > 0 else "")
            )
        return lines

    def _details(self) -> list[str]:
        f = self.fields
        lines = self._finding_lines()
        if f.get("loss") is None and f.get("refused_by"):
            lines.append("loss: not computed (the layer's error interrupted the step)")
        else:
            lines.append(f"loss: {_fmt_loss(f.get('loss'))}")
        lines += _history_lines(f.get("history"))
        if f.get("note"):
            lines.append(f["note"])
        lines.append(
            f"parameters, buffers, optimizer state and RNG states are as before step {f.get('step')}"
        )
        return lines

    def _next_steps(self) -> list[str]:
        f = self.fields
        if f.get("classification") == "transient":
            where = f" (here module '{f['module']}', {f.get('phase')})" if f.get("placed_by") else ""
            return [
                "rerun from here: a transient step that returns often points at the hardware "
                f"(run `python -m cublas_guard_ext doctor`) or a race{where}"
            ]
        refusal = f.get("refusal") or {}
        if f.get("overflow") or (f.get("refused_by") and narrow_format(refusal) is not None):
            # a float16 (bfloat16, fp8) overflow: a wider dtype, autocast, loss scaling, the LR
            where = f"module '{f['module']}'" if f.get("module") else "the layer or op that overflowed"
            facts = {**refusal, "dtype": f.get("dtype") or refusal.get("dtype"), "phase": f.get("phase")}
            return next_steps(facts, where)
        samples = f.get("samples") or {}
        if samples.get("ids") and not samples.get("listed"):
            return [
                f"drop sample{'s' if len(samples['ids']) > 1 else ''} {', '.join(map(str, samples['ids'][:8]))} "
                "from the data (it reproduces), or TrainingGuard(skip_list=PATH) skips the batches "
                "holding it from now on and after a resume"
            ]
        if samples.get("listed"):
            return ["the skip list skips the batches holding these samples from now on, and after a resume"]
        if f.get("refused_by") and refusal.get("role", "input") == "input":
            return [
                "look at the batch of this step: a guarded layer refused it (it reproduces); "
                "on_nan='skip' drops such steps and goes on"
            ]
        if f.get("op"):
            return [
                "fix the op named above (clamp its input, add an epsilon, lower the learning rate); "
                "on_nan='skip' drops such steps and goes on"
            ]
        return ["look at the batch of this step (it reproduces); on_nan='skip' drops such steps and goes on"]


class TrainingDivergedError(NonFiniteStepError):
    """``max_consecutive_skips`` steps in a row were non-finite and skipped: training diverged.

    A :class:`NonFiniteStepError` (the last bad step's fields, not applied either) with
    ``consecutive_skips``, ``skipped_steps`` (their step numbers), ``param_absmax`` and
    ``param_absmax_name`` (the parameters' largest finite absolute value and where; None if
    not known) and ``param_dtype``.
    """

    kind = "training_diverged"

    def _headline(self) -> str:
        f = self.fields
        steps = f.get("skipped_steps") or []
        span = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {f.get('step')}"
        return (
            f"training diverged: {f.get('consecutive_skips')} consecutive steps ({span}) had a "
            "non-finite loss or gradients and were skipped; the last one was not applied either"
        )

    def _details(self) -> list[str]:
        f = self.fields
        lines = _history_lines(f.get("history"))
        absmax = f.get("param_absmax")
        if absmax is not None:
            line = f"parameters' absolute maximum: {format_number(absmax)}"
            if f.get("param_absmax_name"):
                line += f" (in {f['param_absmax_name']})"
            note = range_note(f.get("param_dtype"), absmax, is_product=True)
            lines.append(line + (f"; {note}" if note else ""))
        lines.append(f"last bad step {f.get('step')}:")
        lines += [f"  {line}" for line in self._finding_lines()]
        lines.append(
            f"parameters, buffers, optimizer state and RNG states are as before step {f.get('step')}"
        )
        return lines

    def _next_steps(self) -> list[str]:
        return [
            "lower the learning rate (or add warmup), clip gradients "
            "(torch.nn.utils.clip_grad_norm_), or reload the last good checkpoint; the history above "
            "shows how fast the loss and gradient norm grew",
            "TrainingGuard(max_consecutive_skips=N) tolerates more skipped steps in a row (None: never raise)",
        ]
