"""The errors of ``python -m cublas_guard_ext run`` (:mod:`cublas_guard_ext.run`): a rank stopped
because another failed first (:class:`PeerFailedError`), and an optimizer step refused for
non-finite gradients under ``--raise-on-nonfinite-steps`` (:class:`NonFiniteGradientsError`).
Their fields are in :mod:`.schema` with the rest.
"""

from __future__ import annotations

from .base import GuardError
from .training_steps import NonFiniteStepError


class PeerFailedError(GuardError, RuntimeError):
    """Another rank of this run failed first; this rank was stopped so that it does not wait in
    a collective until the collective's timeout."""

    kind = "peer_failed"

    def _headline(self) -> str:
        f = self.fields
        return (
            f"rank {f.get('failed_rank')} failed first ({f.get('failed_error')}); this rank was stopped "
            "instead of waiting for the collective's timeout"
        )

    def _details(self) -> list[str]:
        f = self.fields
        return [
            f"rank {f.get('failed_rank')}: host {f.get('failed_host')}, pid {f.get('failed_pid')}",
            f"its report: {f.get('failed_report') or '(not written)'}",
        ]

    def _next_steps(self) -> list[str]:
        return [f"read rank {self.fields.get('failed_rank')}'s report: it names what failed there"]


class NonFiniteGradientsError(NonFiniteStepError):
    """``run --raise-on-nonfinite-steps``: an optimizer step whose gradients held NaN/Inf; the
    step was not taken. A :class:`NonFiniteStepError` (catch either) without TrainingGuard's
    replay: ``--watch`` names the op that produced the value."""

    def _headline(self) -> str:
        f = self.fields
        return (
            f"optimizer step {f.get('step')}: non-finite gradients in {f.get('bad_gradient_count')} "
            f"parameters; the step was not taken"
        )

    def _details(self) -> list[str]:
        f = self.fields
        lines = [f"optimizer: {f.get('optimizer')}"]
        if f.get("bad_gradients"):
            more = f["bad_gradient_count"] - len(f["bad_gradients"])
            lines.append(
                "non-finite gradients: "
                + ", ".join(f["bad_gradients"])
                + (f" and {more} more" if more > 0 else "")
            )
        else:
            lines.append("this rank's gradients are finite: another rank's were not (all ranks decide alike)")
        lines.append("parameters and optimizer state are as before this step")
        return lines

    def _next_steps(self) -> list[str]:
        return [
            "name the op that produced it: python -m cublas_guard_ext run --watch ... (the same command)",
            "or go on past such steps: --skip-nonfinite-steps",
        ]
