"""TrainingGuard for Lightning: a callback that checks every micro-batch after its backward.

>>> from cublas_guard_ext.integrations.lightning import TrainingGuardCallback
>>> guard = TrainingGuardCallback(on_nan="skip")
>>> trainer = Trainer(callbacks=[guard], ...); trainer.fit(module, loader)
>>> guard.guard.skipped

Works with ``pytorch_lightning`` and ``lightning`` (whichever is installed; the first found
is used) and automatic optimization. Hooks: ``on_train_batch_start`` keeps the RNG states and
buffers and the batch; ``on_before_backward`` keeps the loss; ``on_after_backward`` checks the
loss and the gradients (one host read per micro-batch) and on a bad one replays
``training_step(batch, batch_idx)`` and its backward under ``watch``. ``"raise"``: the error
leaves ``trainer.fit`` (Lightning calls ``on_exception`` first) before the optimizer steps.
``"skip"``: the gradients are set to None and stay None up to the optimizer step, which
then changes nothing; with ``accumulate_grad_batches`` the whole accumulated step is dropped.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from .._training_state import _RngState
from ..training import TrainingGuard


def _callback_base() -> type:
    for name in ("pytorch_lightning", "lightning.pytorch"):
        try:
            return importlib.import_module(name).Callback
        except ImportError:
            continue
    raise ImportError(
        "cublas_guard_ext.integrations.lightning needs pytorch_lightning or lightning: "
        "pip install pytorch-lightning"
    )


__all__ = ["TrainingGuardCallback"]


class TrainingGuardCallback(_callback_base()):  # type: ignore[misc]
    """See the module docstring. ``guard`` is the TrainingGuard (created at fit start)."""

    def __init__(self, on_nan: str = "raise", allow: Any = ()) -> None:
        if on_nan not in ("raise", "skip"):
            raise ValueError(f"TrainingGuardCallback: on_nan must be 'raise' or 'skip', got {on_nan!r}")
        self.on_nan = on_nan
        self.allow = allow
        self.guard: TrainingGuard | None = None
        self._rng: _RngState | None = None
        self._batch: tuple[Any, int] | None = None
        self._loss: Any = None
        self._drop = False

    def on_fit_start(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        self.guard = TrainingGuard(pl_module, None, on_nan=self.on_nan, allow=self.allow)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.guard is None:
            self.on_fit_start(trainer, pl_module)
        assert self.guard is not None
        self._rng = self.guard._begin()
        self._batch = (batch, batch_idx)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self._loss = loss.detach()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        guard, rng, kept = self.guard, self._rng, self._batch
        if guard is None or rng is None or kept is None or not guard._is_bad(self._loss):
            return
        batch, batch_idx = kept

        def replay() -> torch.Tensor:
            out = pl_module.training_step(batch, batch_idx)
            loss = out["loss"] if isinstance(out, dict) else out
            loss.backward()
            return loss

        name = getattr(pl_module, "_current_fx_name", None)
        try:
            if name is not None:
                pl_module._current_fx_name = "training_step"
            guard._bad_step(replay, rng, self._loss, guard.steps)  # raises, or records the skip
        finally:
            if name is not None:
                pl_module._current_fx_name = name
        self._drop = True

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._drop:
            self._drop = False
            for p in pl_module.parameters():
                p.grad = None  # optimizer.step() skips parameters without a gradient
