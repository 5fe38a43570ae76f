"""TrainingGuard for a ``transformers.Trainer``: every micro-batch checked, a bad one replayed.

>>> from cublas_guard_ext.integrations.transformers import GuardedTrainer
>>> trainer = GuardedTrainer(model=model, args=args, train_dataset=ds, guard_on_nan="skip")
>>> trainer.train()
>>> trainer.guard.skipped          # the NonFiniteStepErrors of the skipped steps

Or mix it into a Trainer subclass of your own: ``class MyTrainer(TrainingGuardMixin, Trainer)``.

``training_step`` (forward and backward of one micro-batch) runs inside ``TrainingGuard.step``
with no optimizer: its loss and the gradients accumulated so far are checked (one host read
per micro-batch); the micro-batches before it were checked finite, so a bad check belongs
to this one, and its replay under ``watch`` uses the same ``inputs``. ``"raise"``: the error
leaves ``trainer.train()`` with parameters, buffers and optimizer state as before the bad
optimizer step. ``"skip"``: the whole optimizer step the micro-batch belongs to is dropped
(its gradients are set to None before ``optimizer.step()``, which then changes nothing);
the Trainer still counts the step and steps its learning-rate scheduler.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from ..training.guard import TrainingGuard

__all__ = ["TrainingGuardMixin", "GuardedTrainer"]


class _DropSkippedStep(transformers.TrainerCallback):
    def __init__(self, trainer: TrainingGuardMixin) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer._guard_drop_step:
            self.trainer._guard_drop_step = False
            for p in self.trainer.model.parameters():
                p.grad = None  # optimizer.step() skips parameters without a gradient


class TrainingGuardMixin:
    """Put before ``transformers.Trainer`` in the bases. Keyword arguments ``guard_on_nan``
    (``"raise"`` or ``"skip"``) and ``guard_allow`` (``watch``'s allow=) are taken from the
    Trainer's; ``self.guard`` is the TrainingGuard (created at the first training step)."""

    def __init__(self, *args: Any, guard_on_nan: str = "raise", guard_allow: Any = (), **kwargs: Any) -> None:
        if guard_on_nan not in ("raise", "skip"):
            raise ValueError(
                f"TrainingGuardMixin: guard_on_nan must be 'raise' or 'skip', got {guard_on_nan!r}"
            )
        super().__init__(*args, **kwargs)
        self._guard_on_nan = guard_on_nan
        self._guard_allow = guard_allow
        self._guard_drop_step = False
        self.guard: TrainingGuard | None = None
        self.guard_state: dict[str, Any] | None = None
        self.add_callback(_DropSkippedStep(self))

    def load_guard_state(self, state: dict[str, Any]) -> None:
        """A saved ``trainer.guard.state_dict()``: loaded now, or when the guard is created."""
        if self.guard is not None:
            self.guard.load_state_dict(state)
        else:
            self.guard_state = state

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if self.guard is None or self.guard.model is not model:
            self.guard = TrainingGuard(model, None, on_nan=self._guard_on_nan, allow=self._guard_allow)
            if self.guard_state is not None:  # load_guard_state() before the first step
                self.guard.load_state_dict(self.guard_state)
                self.guard_state = None
        parent = super()

        def micro_batch() -> torch.Tensor:
            return parent.training_step(model, inputs, *args, **kwargs)

        loss = self.guard.step(micro_batch)
        if loss is None:  # skipped: drop this optimizer step
            self._guard_drop_step = True
            return torch.tensor(float("nan"), device=self.args.device)
        return loss


class GuardedTrainer(TrainingGuardMixin, transformers.Trainer):
    """``transformers.Trainer`` with a TrainingGuard on every training step."""
