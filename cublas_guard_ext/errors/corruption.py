"""The error of a step whose numbers cannot be trusted although they are finite
(:class:`SilentCorruptionError`): replicas that disagree, or a rerun verdict of
``TrainingGuard(silent_corruption=...)`` that is not clean. Written from plain values
(every rank builds the same error from the same exchanged facts), like every message here.

The verdicts, in Megatron's vocabulary and more (docs/silent-corruption.md):

* ``replicas_differ``: replicas' parameters are not bitwise equal (checked every N steps);
* ``transient``: the step and its rerun (same batch, RNG states, buffers) differ, and the
  reruns agree with each other: a one-off on this device;
* ``persistent``: the step reproduces, but one rank's replay of the first suspicious GEMM's
  operands differs from another rank's replay of the same operands: that device computes
  it wrong every time.
"""

from __future__ import annotations

from typing import Any

from .base import GuardError
from .magnitudes import format_number

VERDICTS = ("replicas_differ", "transient", "persistent", "reproducible")

# Megatron-LM's exit codes (rerun_state_machine.py): 16 "rerun elsewhere" (the hardware is
# suspect: restart the job away from the named node), 17 "validation failed" (the numbers
# reproduce: restarting elsewhere will not help).
EXIT_RERUN_ELSEWHERE = 16
EXIT_VALIDATION_FAILED = 17
DEFAULT_EXIT_CODES = {
    "replicas_differ": EXIT_RERUN_ELSEWHERE,
    "transient": EXIT_RERUN_ELSEWHERE,
    "persistent": EXIT_RERUN_ELSEWHERE,
    "reproducible": EXIT_VALIDATION_FAILED,
}


def _who(f: dict[str, Any]) -> str:
    parts = [f"host {f.get('host') or '?'}", f"device {f.get('device') or '?'}"]
    if f.get("gpu_uuid"):
        parts.append(f"GPU UUID {f['gpu_uuid']}")
    return ", ".join(parts)


def where_text(f: dict[str, Any]) -> str:
    """'module 'fc1' (forward output; its GEMM: ...)', or what is known of the place."""
    if f.get("module") is None and f.get("what") is None:
        return "the place is not known"
    module = f.get("module")
    text = f"module '{module}'" if module else "the model's own code (no submodule)"
    inner = ", ".join(str(f[k]) for k in ("phase", "what") if f.get(k))
    if inner:
        text += f" ({inner})"
    if f.get("gemm"):
        text += f"; its GEMM: {f['gemm']}"
    return text


class SilentCorruptionError(GuardError, RuntimeError):
    """Finite numbers that cannot be trusted: replicas whose parameters differ, or a step whose
    rerun verdict is ``transient`` or ``persistent``. Raised on every rank alike (they learn it
    in the same collective), before the optimizer step: nothing of the step was applied.

    Fields: ``verdict`` (``"replicas_differ"``, ``"transient"``, ``"persistent"``), ``step``,
    ``rank`` (the rank named: whose parameters differ, whose run differed, whose device
    computes a GEMM wrong), ``ranks`` (every rank that differed), ``world_size``, ``host``,
    ``device``, ``gpu_uuid`` (of the rank named; None without CUDA), ``parameter`` (the first
    differing parameter by qualified name), ``differing_parameters`` (how many differ),
    ``module``, ``phase`` (``"forward"`` / ``"backward"``), ``what`` (the module's output, the
    gradient at its input, a parameter's gradient), ``gemm`` (the GEMM inside the module, for a
    Linear-like module), ``trigger`` (what started the rerun), ``loss``, ``rerun_loss``,
    ``comparison`` (bitwise, or the calibrated tolerance and how it was calibrated),
    ``replays`` (persistent: each rank's replay of the capsule), ``note``, ``exit_code`` (the
    opt-in process exit code for this verdict, else None). ``capsule``: the GEMM's capsule
    file, when one was written (on the named rank's host).
    """

    kind = "silent_corruption"

    def _headline(self) -> str:
        f = self.fields
        step = f"training step {f.get('step')}"
        verdict = f.get("verdict")
        if verdict == "replicas_differ":
            return (
                f"{step}: replicas disagree: parameter '{f.get('parameter')}' on rank {f.get('rank')} "
                "differs from the other replicas'; no optimizer step was taken"
            )
        if verdict == "persistent":
            return (
                f"{step}: silent data corruption, persistent on rank {f.get('rank')}: its replay of "
                f"the GEMM in {where_text(f)} differs from another rank's replay of the same "
                "operands; no optimizer step was taken"
            )
        on = f" on rank {f['rank']}" if f.get("rank") is not None else ""
        return (
            f"{step}: silent data corruption, {verdict}{on}: the step and its rerun first differ in "
            f"{where_text(f)}; no optimizer step was taken"
        )

    def _details(self) -> list[str]:
        f = self.fields
        lines = [f"verdict: {f.get('verdict')}"]
        if f.get("trigger"):
            lines.append(f"trigger: {f['trigger']}")
        if f.get("verdict") == "replicas_differ":
            count = f.get("differing_parameters")
            lines.append(
                f"first differing parameter: {f.get('parameter')}"
                + (f" ({count} parameters differ)" if count else "")
            )
        else:
            lines.append(f"first difference: {where_text(f)}")
        lines.append(f"rank {f['rank']}: {_who(f)}" if f.get("rank") is not None else f"where: {_who(f)}")
        others = [r for r in f.get("ranks") or [] if r != f.get("rank")]
        if others:
            lines.append(f"also differing: ranks {others}")
        for replay in f.get("replays") or []:
            lines.append(
                f"replay of the capsule on rank {replay.get('rank')} ({replay.get('host')}, "
                f"{replay.get('device')}): signature {replay.get('signature')}"
                + (" (the named rank)" if replay.get("rank") == f.get("rank") else "")
            )
        if f.get("loss") is not None or f.get("rerun_loss") is not None:
            loss, rerun = f.get("loss"), f.get("rerun_loss")
            lines.append(
                f"loss: {format_number(loss) if loss is not None else '-'} in the step, "
                f"{format_number(rerun) if rerun is not None else '-'} in the rerun"
            )
        if f.get("comparison"):
            lines.append(f"comparison: {f['comparison']}")
        if f.get("note"):
            lines.append(str(f["note"]))
        lines.append(
            f"parameters, buffers, optimizer state and RNG states are as before step {f.get('step')}"
        )
        if f.get("exit_code") is not None:
            lines.append(f"exit code: {f['exit_code']} if this error ends the process")
        return lines

    def _next_steps(self) -> list[str]:
        f = self.fields
        verdict = f.get("verdict")
        who = f"rank {f['rank']} ({_who(f)})" if f.get("rank") is not None else f"this process ({_who(f)})"
        if verdict == "replicas_differ":
            return [
                f"restart from the last checkpoint away from {who}: replicas that disagree cannot "
                "both be right, and every later step averages the wrong copy in",
                "run `python -m cublas_guard_ext doctor` on that node; if it happens again there, cordon it",
            ]
        if verdict == "persistent":
            return [
                f"cordon {who}: its device computes this GEMM wrong every time (the capsule replays it "
                "there: python -m cublas_guard_ext replay CAPSULE)",
                "restart from the last checkpoint on other hardware",
            ]
        return [
            f"the reruns agree, the step did not: a one-off fault on {who}; if it returns on the "
            "same device, cordon it (run `python -m cublas_guard_ext doctor` there)",
            "the step was not applied; TrainingGuard(silent_corruption=SilentCorruptionChecks("
            "on_verdict='skip')) drops such steps and goes on",
        ]
