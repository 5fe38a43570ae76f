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

A guarded layer (SafeLinear) that refuses a NaN/Inf inside ``training_step`` or its backward
makes a bad step like any other: the callback wraps the module's ``training_step`` and
``backward`` for the fit (as instance attributes, removed when the fit ends), replays the
step, and raises :class:`~cublas_guard_ext.NonFiniteStepError` (the layer's error as its
``__cause__``) or skips it (``training_step`` returns None: Lightning then skips the
optimizer step, and says so in a warning of its own).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ..training.guard import NON_FINITE_REFUSALS, TrainingGuard
from ..training.state import _RngState


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
        self._refused = False  # this micro-batch's step was already handled as refused
        self._originals: dict[str, Any] = {}
        self._restored: dict[str, Any] | None = None  # guard state from a checkpoint, until fit start

    def on_fit_start(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        self.guard = TrainingGuard(pl_module, None, on_nan=self.on_nan, allow=self.allow)
        if self._restored is not None:  # a checkpoint's state, loaded before the fit started
            self.guard.load_state_dict(self._restored)
            self._restored = None
        self._wrap(pl_module)

    # Lightning saves and restores a callback's state with the checkpoint by itself.
    def state_dict(self) -> dict[str, Any]:
        if self.guard is not None:
            return {"training_guard": self.guard.state_dict()}
        return {"training_guard": self._restored} if self._restored is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("training_guard")
        if state is not None and self.guard is not None:
            self.guard.load_state_dict(state)
        else:
            self._restored = state

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._unwrap(pl_module)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._unwrap(pl_module)

    # -- a guarded layer's refusal inside training_step or backward -------------------------
    def _wrap(self, pl_module: Any) -> None:
        if self._originals:
            return
        # the bound methods, or instance attributes the user set (kept and put back)
        saved = {name: pl_module.__dict__.get(name) for name in ("training_step", "backward")}
        self._originals = {"saved": saved, "training_step": pl_module.training_step}
        original_step, original_backward = pl_module.training_step, pl_module.backward

        def training_step(*args: Any, **kwargs: Any) -> Any:
            try:
                return original_step(*args, **kwargs)
            except NON_FINITE_REFUSALS as refusal:
                self._on_refusal(pl_module, refusal)  # raises, or records the skip
                return None  # Lightning skips the optimizer step

        def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            try:
                original_backward(loss, *args, **kwargs)
            except NON_FINITE_REFUSALS as refusal:
                self._on_refusal(pl_module, refusal)

        pl_module.training_step = training_step
        pl_module.backward = backward

    def _unwrap(self, pl_module: Any) -> None:
        if not self._originals:
            return
        for name, value in self._originals["saved"].items():
            if value is None:
                pl_module.__dict__.pop(name, None)
            else:
                pl_module.__dict__[name] = value
        self._originals = {}

    def _on_refusal(self, pl_module: Any, refusal: BaseException) -> None:
        guard, rng = self.guard, self._rng
        if guard is None or rng is None or self._batch is None:
            raise refusal
        self._refused = True
        self._drop = True
        guard.reject(self._replay_closure(pl_module), rng, refusal=refusal)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.guard is None:
            self.on_fit_start(trainer, pl_module)
        assert self.guard is not None
        self._rng = self.guard.begin()
        self._batch = (batch, batch_idx)
        self._refused = False

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self._loss = loss.detach()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        guard, rng, kept = self.guard, self._rng, self._batch
        if self._refused or guard is None or rng is None or kept is None or not guard.is_bad(self._loss):
            return
        self._drop = True
        guard.reject(self._replay_closure(pl_module), rng, self._loss)  # or raises

    def _replay_closure(self, pl_module: Any) -> Any:
        """The micro-batch again: the module's own training_step (not the wrapper) and backward."""
        assert self._batch is not None
        batch, batch_idx = self._batch
        step = self._originals.get("training_step", pl_module.training_step)

        def replay() -> torch.Tensor:
            name = getattr(pl_module, "_current_fx_name", None)
            try:
                if name is not None:
                    pl_module._current_fx_name = "training_step"
                out = step(batch, batch_idx)
            finally:
                if name is not None:
                    pl_module._current_fx_name = name
            loss = out["loss"] if isinstance(out, dict) else out
            loss.backward()
            return loss

        return replay

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._drop:
            self._drop = False
            for p in pl_module.parameters():
                p.grad = None  # optimizer.step() skips parameters without a gradient
