"""TrainingGuard (guard.py): one guarded training step, a bad step skipped or replayed; and
the state it keeps between steps (state.py: RNG snapshots, buffers, the step history, the
process group as ``guard.collective``)."""

from __future__ import annotations

from .guard import NON_FINITE_REFUSALS, NonFiniteStepError, TrainingDivergedError, TrainingGuard

__all__ = ["TrainingGuard", "NON_FINITE_REFUSALS", "NonFiniteStepError", "TrainingDivergedError"]
