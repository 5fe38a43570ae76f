"""``TrainingGuard``: catch a non-finite training step for almost nothing, replay it under
``watch`` to name the op, and never let it touch the model.

>>> guard = cublas_guard_ext.TrainingGuard(model, optimizer, on_nan="raise")   # or "skip"
>>> for batch in loader:
...     def closure(batch=batch):
...         optimizer.zero_grad()
...         loss = loss_fn(model(batch))
...         loss.backward()
...         return loss
...     loss = guard.step(closure)      # optimizer.step() only when the loss and every grad are finite

Healthy steps cost one fused pass over the gradients (GradScaler's own non-finite check,
per device and dtype, joined with the loss's into one flag tensor) and one read of that flag: one host
sync per step on CUDA, like GradScaler, and none with ``deferred=True`` (then the optimizer
must skip on the device: a ``fused=True`` Adam/AdamW/SGD takes the flag as its ``found_inf``,
and the flag is read at the next ``step`` or at :meth:`TrainingGuard.check`). Before the
closure runs, the guard keeps the RNG states (CPU, every initialised CUDA device, Python's
``random``, NumPy's global one) and a copy of every buffer (BatchNorm statistics and the like).

A bad step is never applied: no optimizer step. The RNG states and buffers are restored and
the closure runs again under ``watch(model, mode="sync")`` (a compiled model runs eagerly
there, so modules are named), which names the producing op, module and phase; the step is
``"persistent"`` when the replay is non-finite again, ``"transient"`` when it is not. Then
the RNG states and buffers are restored once more and the gradients are set to None, so
parameters, buffers, optimizer state and the RNG streams are exactly as before the step:
``on_nan="raise"`` raises :class:`NonFiniteStepError`; ``"skip"`` warns with the same text,
appends the error to ``guard.skipped``, returns None, and the run goes on as if the step's
batch had never been drawn.

Distributed (DDP, FSDP2; any initialised process group of more than one rank): each step
all-reduces the flag (MAX) so every rank decides alike. On a bad step every rank replays
locally (DDP under ``no_sync()``; FSDP2 with the parameters gathered first and gradient
reduction off), the ranks exchange what their replays found (one ``all_gather_object``, only
on a bad step), and every rank raises or skips with the same error, naming the producer's rank.

The policy is here; the pieces without one (RNG and buffer copies, the fused check, DDP /
compile unwrapping, FSDP2's replay set-up, the replay's watch) are in ``state.py``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors.training_steps import NonFiniteStepError, TrainingDivergedError
from ..watching import optimizer_step as _optimizer_step
from . import checkpoint, replay
from . import samples as _samples
from . import skip_list as _skip_list
from .replay import NON_FINITE_REFUSALS
from .silent_corruption import SilentCorruptionChecks
from .state import (
    Collective,
    StepHistory,
    _bad_flag,
    _Buffers,
    _default_group,
    _grad_norm,
    _loss_value,
    _param_absmax,
    _refusal_fields,
    _refusal_layer,
    _RngState,
    _unwrap,
)

__all__ = ["TrainingGuard", "NonFiniteStepError", "TrainingDivergedError"]

_ON_NAN = ("raise", "skip")


class TrainingGuard:
    """Guard every optimizer step: take it only when the loss and every gradient are finite;
    replay a bad one under ``watch`` to name the op; never let it touch the model.

    Call :meth:`step` with a closure (zero_grad, forward, backward; returns the loss) instead
    of ``optimizer.step()``. A healthy step is the closure plus one fused finite check of the
    loss and gradients and ``optimizer.step()``. A bad step (a NaN/Inf loss or gradient, or a
    guarded layer such as SafeLinear refusing a NaN/Inf inside the closure) is not applied:
    RNG states and buffers are restored, the closure runs again under ``watch`` to name the
    producing op, module and phase, then everything is restored once more, so parameters,
    buffers, optimizer state and RNG streams are exactly as before the step.

    Arguments:

    * ``model``: the module trained (DDP / ``torch.compile`` wrappers are fine).
    * ``optimizer``: the one ``step`` steps (None: only check; the integrations use that).
    * ``on_nan``: ``"raise"`` a :class:`NonFiniteStepError` (a guarded layer's error is its
      ``__cause__``), or ``"skip"``: warn (``RuntimeWarning``, same text), append the error to
      ``guard.skipped``, return None, go on as if the batch had never been drawn.
    * ``max_consecutive_skips`` (3): that many skipped steps in a row raise
      :class:`TrainingDivergedError` with the loss and gradient-norm history (None: never).
    * ``history`` (6): steps whose loss and gradient norm the messages show (0: none, and no
      norm is computed).
    * ``scaler``: a ``torch.amp.GradScaler`` the closure scales with
      (``scaler.scale(loss).backward()``, returning the unscaled loss); the guard unscales,
      steps and updates it; a step it skips for Inf gradients is not a finding.
    * ``deferred``: no host sync in the step (needs a ``fused=True`` Adam/AdamW/SGD, which
      skips on the device); the flag is read at the next ``step`` or :meth:`check`, and a bad
      step's error, raised then, has ``deferred=True`` (the field's one meaning everywhere: a
      finding read after the call or step that made it, not in it).
    * ``allow``: passed to the replay's ``watch`` (ops or modules where NaN/Inf is intended).
    * ``process_group``: ``"auto"`` (the default group when more than one rank), None, or a group.
    * ``silent_corruption``: a :class:`SilentCorruptionChecks` (replicas that disagree, loss or
      gradient-norm spikes rerun to a verdict; docs/silent-corruption.md), or None.
    * ``skip_list``: a JSON-lines file (:mod:`.skip_list`): a reproducible bad step appends the
      culprit samples ``step(closure, sample_ids=...)`` named; a later batch holding one is
      skipped before its closure runs (every rank alike), also after a resume.

    Example (the guard's real output)::

        >>> model = cg.replace_linear(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> guard = cg.TrainingGuard(model, opt, on_nan="raise")
        >>> def closure():
        ...     opt.zero_grad(); loss = F.mse_loss(model(x), y); loss.backward(); return loss
        >>> guard.step(closure)
        tensor(2.3982, grad_fn=<MseLossBackward0>)
        >>> x[1, 3] = float("nan"); guard.step(closure)
        NonFiniteStepError: training step 2: layer '0' refused a non-finite input (NaN 1, +Inf 0, -Inf 0); no optimizer step was taken
          replayed under watch: watch: the model's argument 'input' has 1 NaN, 0 +Inf, 0 -Inf on entry (it came into the model non-finite; no op inside produced it)
          persistent: the replay (same batch, same RNG states) is non-finite again
          loss: not computed (the layer's error interrupted the step)
          recent steps (loss, gradient norm):
            step 1: loss 2.39825, gradient norm 4.00866
            step 2: refused by layer '0' before a loss was computed
          parameters, buffers, optimizer state and RNG states are as before step 2
        Next: look at the batch of this step: a guarded layer refused it (it reproduces); on_nan='skip' drops such steps and goes on

    Costs: ~1% of an all-MiniLM-L6-v2 AdamW step on a CPU (docs/training-guard.md), one host
    read (none deferred), one 4-byte all-reduce when distributed; a bad step one more forward
    and backward under ``watch``. More: docs/training-guard.md.

    For integrations that own no closure (a trainer's hooks): :meth:`begin`, :meth:`is_bad`,
    then :meth:`apply` or :meth:`reject` (what :meth:`step` is made of), :meth:`restore`,
    ``collective``, ``history``, ``batch``, :meth:`parameters` (docs/training-guard.md, "For
    integrations"); nothing else of the guard is theirs to touch.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        on_nan: str = "raise",
        *,
        scaler: Any = None,
        deferred: bool = False,
        allow: Iterable[Any] = (),
        process_group: Any = "auto",
        max_consecutive_skips: int | None = 3,
        history: int = 6,
        silent_corruption: SilentCorruptionChecks | None = None,
        skip_list: Any = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"TrainingGuard: model must be an nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"TrainingGuard: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if on_nan not in _ON_NAN:
            raise ValueError(f"TrainingGuard: on_nan must be 'raise' or 'skip', got {on_nan!r}")
        if max_consecutive_skips is not None and (
            isinstance(max_consecutive_skips, bool)
            or not isinstance(max_consecutive_skips, int)
            or max_consecutive_skips < 1
        ):
            raise ValueError(
                "TrainingGuard: max_consecutive_skips must be a positive int (the skipped steps in a "
                f"row that mean training diverged) or None (never raise), got {max_consecutive_skips!r}"
            )
        if isinstance(history, bool) or not isinstance(history, int) or history < 0:
            raise ValueError(
                f"TrainingGuard: history must be an int >= 0 (steps kept for messages), got {history!r}"
            )
        if deferred:
            if optimizer is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
                raise ValueError(
                    "TrainingGuard(deferred=True) needs an optimizer that skips a step on the device "
                    f"(torch.optim.Adam/AdamW/SGD(..., fused=True)), got {type(optimizer).__name__} "
                    "without fused=True; use deferred=False (one host sync per step)"
                )
            if scaler is not None:
                raise ValueError(
                    "TrainingGuard: deferred=True with scaler= is not supported: "
                    "GradScaler reads its own Inf check on the host; use deferred=False"
                )
        self.model = model
        self.inner = _unwrap(model)
        self.optimizer = optimizer
        self.on_nan = on_nan
        self.scaler = scaler
        self.deferred = deferred
        self.allow = list(allow) if not isinstance(allow, str) else [allow]
        self.collective = Collective(_default_group() if process_group == "auto" else process_group)
        self.steps = 0
        self.skipped: list[NonFiniteStepError] = []
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = 0
        self._history = StepHistory(history)
        if optimizer is not None and history:  # a finding born in its step quotes this history
            _optimizer_step.keep_history(optimizer, self._history.read)
        self.scaler_skips = 0
        self.stepped = False  # whether the last step() took the optimizer step (for a scheduler)
        self._buffers = _Buffers(self.inner)
        self._pending: tuple[Any, ...] | None = None  # deferred: the last step, not yet read
        self._names: dict[int, str] | None = None
        self.silent_corruption = silent_corruption._attach(self) if silent_corruption is not None else None
        self._batch: _samples.StepBatch | None = None  # this step's sample_ids, if given
        self.list_skips = 0  # batches skipped before their closure: they held a listed sample
        self.restored_skipped_steps: list[int] = []  # on_nan="skip"'s steps before a resume
        self.skip_list = _skip_list.open_skip_list(self, skip_list)

    # -- for the integrations and the checks (docs/training-guard.md, "For integrations") --------
    @property
    def group(self) -> Any:
        """The process group the ranks decide over (None: one process); ``collective`` uses it."""
        return self.collective.group

    @property
    def history(self) -> StepHistory:
        """The last ``history`` steps' loss, gradient norm, skip and refusal (messages read it)."""
        return self._history

    @property
    def batch(self) -> _samples.StepBatch | None:
        """This step's ``sample_ids`` and the batch they name, or None (no ids given)."""
        return self._batch

    def parameters(self) -> list[torch.Tensor]:
        """The parameters the guard checks: the optimizer's, in its param groups' order (without
        an optimizer, the model's that require a gradient)."""
        if self.optimizer is not None:
            return [p for g in self.optimizer.param_groups for p in g["params"]]
        return [p for p in self.model.parameters() if p.requires_grad]

    def restore(self, rng: _RngState, *, optimizer: bool = False) -> None:
        """Undo what this step's closure did: the RNG states ``rng`` (from :meth:`begin`) and every
        buffer put back, every gradient set to None; ``optimizer=True`` also calls the
        optimizer's ``zero_grad(set_to_none=True)`` (a step that is dropped, not run again)."""
        rng.restore()
        self._buffers.restore()
        self._zero_grads()
        if optimizer and self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.parameters() if p.grad is not None]

    def _zero_grads(self) -> None:
        for p in self.parameters():
            p.grad = None
        for p in self.inner.parameters():
            p.grad = None

    def _bad_gradients(self) -> list[str]:
        if self._names is None:
            self._names = {id(p): n for n, p in self.inner.named_parameters()}
        bad = []
        for p in self.parameters():
            g = p.grad
            g = g.to_local() if hasattr(g, "to_local") else g
            if g is not None and not bool(torch.isfinite(g.coalesce().values() if g.is_sparse else g).all()):
                bad.append(self._names.get(id(p), f"<parameter {tuple(p.shape)}>"))
        return bad

    # -- the step --------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any], *, sample_ids: Any = None, batch: Any = None) -> Any:
        """Run ``closure`` (zero_grad, forward, backward; returns the loss), check it, and take
        the optimizer step only when the loss and every gradient are finite. Returns the loss,
        or None for a step skipped by ``on_nan="skip"`` (or by the skip list). ``self.stepped``
        says whether the optimizer stepped (False also when a scaler skipped the step for Inf
        gradients).

        ``sample_ids``: one integer id per row of the batch (a list, or a 1-D CPU integer
        tensor); a bad step then names its culprit samples, and the skip list skips a batch
        that holds a listed one before the closure runs. The batch is what the model is called
        with inside the closure (its leading dimension), or ``batch=`` when given."""
        if not callable(closure):
            raise TypeError(f"TrainingGuard.step: closure must be callable, got {type(closure).__name__}")
        if self.deferred:
            self.check()
        self._batch = _samples.StepBatch.of(self, sample_ids, batch)
        if self.skip_list is not None and _skip_list.skip_listed(self):
            return None  # before the closure: no forward, backward or collective
        rng = self.begin()
        checks = self.silent_corruption
        try:
            with self._batch.capture if self._batch is not None else contextlib.nullcontext():
                loss = closure() if checks is None else checks.run_closure(closure)
            if self._batch is not None:
                self._batch.check(self, rng)
                loss = self._batch.reduce(loss)  # per-sample losses: kept, their mean judged
        except NON_FINITE_REFUSALS as refusal:
            return self._refused_step(closure, rng, refusal)
        if self.scaler is not None:
            return self._step_scaled(closure, rng, loss)
        grads = self._grads()
        flag = _bad_flag(loss, grads, True)
        self._note(loss, grads)
        if flag is None:  # nothing to check: no loss, no gradient
            return self.apply(loss)
        if self.deferred:
            return self._step_deferred(closure, rng, loss, flag)
        if checks is not None:  # replicas, spikes, checked steps: still one collective, one read
            return checks.decide(closure, rng, loss, flag)
        if not self._read(flag):
            return self.apply(loss)
        return self._bad_step(closure, rng, loss, self.steps)

    # The pieces step() is made of, public for the integrations (Trainer, Lightning: they call
    # them from hooks) and the silent-corruption checks: begin, is_bad, then apply or reject.
    def begin(self) -> _RngState:
        """Before a step's forward: count it, keep the RNG states (returned: hand them to
        :meth:`reject` or :meth:`restore`) and copy every buffer."""
        self.steps += 1
        self.stepped = False
        rng = _RngState()
        self._buffers.snapshot()
        return rng

    def is_bad(self, loss: Any) -> bool:
        """After the backward: whether the step was bad on some rank (the loss or a gradient
        NaN/Inf). Notes the loss and gradient norm for the messages, joins the ranks (one
        all-reduce) and reads the flag (one host sync); a good step resets the skip count."""
        grads = self._grads()
        flag = _bad_flag(loss, grads, True)
        self._note(loss, grads)
        if flag is None:
            flag = torch.zeros(())
        bad = self._read(flag)
        if not bad:
            self.consecutive_skips = 0
        return bad

    def apply(self, loss: Any) -> Any:
        """A good step: ``optimizer.step()`` (when there is an optimizer); returns ``loss``."""
        self.consecutive_skips = 0
        if self.optimizer is not None:
            self.optimizer.step()
            self.stepped = True
        return loss

    def reject(
        self,
        closure: Callable[[], Any],
        rng: _RngState,
        loss: Any = None,
        *,
        refusal: BaseException | None = None,
    ) -> None:
        """A bad step (this one, :attr:`steps`): replay ``closure`` from ``rng`` under ``watch``,
        put everything back as before the step, then raise :class:`NonFiniteStepError` or skip
        (``on_nan``). ``refusal``: the error a guarded layer raised inside the step instead of
        returning a loss (it becomes the cause); the other ranks are met in their flag's
        all-reduce first. Returns None on a skip; every rank must call it together."""
        if refusal is not None:
            return self._refused_step(closure, rng, refusal)
        return self._bad_step(closure, rng, loss, self.steps)

    def _read(self, flag: torch.Tensor) -> bool:
        """Whether some rank's step was bad: the all-reduce (if any), then the one host read."""
        if self.silent_corruption is not None:
            return self.silent_corruption.read(flag)
        return self.collective.agree(flag).item() != 0.0

    def _note(self, loss: Any, grads: list[torch.Tensor]) -> None:
        """Keep this step's loss and gradient norm for the messages (device tensors, no sync)."""
        if self._history.entries.maxlen:
            self._history.add(self.steps, loss, _grad_norm(grads))

    def _refused_step(self, closure: Callable[[], Any], rng: _RngState, refusal: BaseException) -> None:
        """A guarded layer (or the user's watch) raised about a NaN/Inf inside the closure: a
        non-finite step like any other (replayed, nothing applied), the error its cause."""
        if self.group is not None:
            # the other ranks' steps reach the flag's all-reduce: meet them there
            self._read(torch.ones(()))
        refused_by = _refusal_layer(refusal)
        self._history.mark(self.steps, refused_by=refused_by or "?")
        return self._bad_step(closure, rng, None, self.steps, refusal=refusal)

    def _step_scaled(self, closure: Callable[[], Any], rng: _RngState, loss: Any) -> Any:
        scaler, opt = self.scaler, self.optimizer
        assert opt is not None, "TrainingGuard: scaler= needs the optimizer"
        state = scaler._per_optimizer_states[id(opt)]
        if scaler.is_enabled() and state["stage"].name == "READY":
            scaler.unscale_(opt)  # the scaler's own fused Inf check (found_inf per device)
        self._note(loss, self._grads())
        found = list(state["found_inf_per_device"].values()) if scaler.is_enabled() else []
        loss_flag = _bad_flag(loss, [], False)
        parts = [f.reshape(()).float().to(found[0].device) for f in found]
        if loss_flag is not None:
            parts.insert(0, loss_flag.to(parts[0].device if parts else loss_flag.device))
        if not parts:
            return self.apply(loss)
        flags = torch.stack(parts)
        flags = self.collective.agree(flags)
        loss_bad, *grads_bad = flags.tolist() if loss_flag is not None else [0.0, *flags.tolist()]
        if loss_bad:
            # the scaler has unscaled but not stepped: forget that, as if the step never ran
            from torch.amp.grad_scaler import _refresh_per_optimizer_state

            scaler._per_optimizer_states[id(opt)] = _refresh_per_optimizer_state()
            return self._bad_step(closure, rng, loss, self.steps)
        if any(grads_bad):
            self.scaler_skips += 1
            scaler.update()  # lowers the scale; no optimizer step (what scaler.step would do)
            return loss
        self.apply(loss)
        scaler.update()
        return loss

    def _step_deferred(
        self, closure: Callable[[], Any], rng: _RngState, loss: Any, flag: torch.Tensor
    ) -> Any:
        opt = self.optimizer
        assert opt is not None
        flag = self.collective.agree(flag)  # NCCL: ordered on the stream, no host wait
        opt.grad_scale, opt.found_inf = None, flag.to(self.parameters()[0].device, non_blocking=True)
        try:
            opt.step()  # skipped on the device when the flag is 1
        finally:
            del opt.grad_scale, opt.found_inf
        self.stepped = True  # submitted: the device skips it if the flag (read later) is 1
        host = flag.to("cpu", non_blocking=True)
        event = None
        if flag.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._pending = (closure, rng, loss, host, event, self.steps, self._buffers.kept, self._batch)
        return loss

    def check(self) -> None:
        """Deferred mode: read the last step's flag now (the next ``step`` does it too); raise or
        skip as for an undeferred bad step. Call it after the last step of a run."""
        if self._pending is None:
            return
        closure, rng, loss, host, event, step, kept, batch = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        if host.item() == 0.0:
            self.consecutive_skips = 0
            return
        # the fused optimizer skipped the step; buffers and RNG go back to before it
        self._buffers.kept = kept
        self._batch = batch
        self._bad_step(closure, rng, loss, step, deferred=True)

    # -- the bad step ------------------------------------------------------------------------
    def _bad_step(
        self,
        closure: Callable[[], Any],
        rng: _RngState,
        loss: Any,
        step: int,
        refusal: BaseException | None = None,
        deferred: bool = False,
    ) -> None:
        loss_value = _loss_value(loss)
        bad_grads = self._bad_gradients()
        self._zero_grads()
        local_bad = (
            (loss_value is not None and not math.isfinite(loss_value))
            or bool(bad_grads)
            or refusal is not None
        )
        record = None  # a checked step's record of the faulty run, module by module
        if self.silent_corruption is not None:
            record, self.silent_corruption.original = self.silent_corruption.original, None
        result = self._replay(closure, rng)
        if not result["reproduced"]:
            replay.place_transient(self, closure, rng, result, refusal, record)
        cause = refusal if refusal is not None else result.pop("exception")
        result.pop("exception", None)
        rank, world = self.collective.rank, self.collective.world
        report = {
            "rank": rank,
            "local_bad": local_bad,
            "loss": loss_value,
            "bad": bad_grads,
            "refused_by": _refusal_layer(refusal) if refusal is not None else None,
            "refusal": _refusal_fields(refusal) if refusal is not None else None,
            **result,
        }
        reports = self.collective.gather(report)
        self.restore(rng, optimizer=True)  # once more: the replay drew random numbers, wrote buffers
        if self.on_nan == "skip":
            self._history.mark(step, skipped=True)
        history = self._history.read()
        err = self._error(step, reports, rank, world, history, deferred)
        _skip_list.record_culprits(self, err, reports)
        if self.on_nan == "raise":
            raise err from cause
        err.__cause__ = cause  # as a raise ... from cause would set it
        self.consecutive_skips += 1
        self.skipped.append(err)
        if self.max_consecutive_skips is not None and self.consecutive_skips >= self.max_consecutive_skips:
            skipped_steps = [e.step for e in self.skipped[-self.consecutive_skips :]]
            absmax, where, dtype = _param_absmax(self.inner)
            diverged = TrainingDivergedError(
                **err.fields,
                consecutive_skips=self.consecutive_skips,
                skipped_steps=skipped_steps,
                param_absmax=absmax,
                param_absmax_name=where,
                param_dtype=dtype,
            )
            self.consecutive_skips = 0
            raise diverged from cause
        warnings.warn(str(err), RuntimeWarning, stacklevel=3)
        return None

    def _replay(self, closure: Callable[[], Any], rng: _RngState) -> dict[str, Any]:
        """Run the closure again from the same RNG and buffers, under watch; what it found
        (and, with ``sample_ids``, the rows of the batch where the bad values appear)."""
        return replay.run(self, closure, rng)

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to judge steps as this one would: the step count, the
        skip counters, the history the messages show and the spike detector's window."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` gave (the skip list itself is re-read from its file)."""
        checkpoint.load_state_dict(self, state)

    def _error(
        self,
        step: int,
        reports: list[dict],
        rank: int | None,
        world: int | None,
        history: list[dict[str, Any]],
        deferred: bool = False,
    ) -> NonFiniteStepError:
        refused = [r for r in reports if r["refused_by"] is not None]
        named = [r for r in reports if r["finding"] is not None]
        reproduced = [r for r in reports if r["reproduced"]]
        loss_bad = [r for r in reports if r["loss"] is not None and not math.isfinite(r["loss"])]
        local = [r for r in reports if r["local_bad"]]
        placed = [r for r in reports if r.get("placed_by")]
        origin = (refused or named or reproduced or placed or loss_bad or local or reports)[0]
        note = origin.get("note")
        if len(reports) > 1 and len(reproduced) > 1:
            extra = f"reproduced on ranks {[r['rank'] for r in reproduced]}"
            note = f"{note}; {extra}" if note else extra
        return NonFiniteStepError(
            step=step,
            loss=origin["loss"],
            module=origin["module"],
            op=origin["op"],
            phase=origin["phase"],
            classification="persistent" if reproduced else "transient",
            rank=origin["rank"],
            world_size=world,  # None outside distributed runs, like rank
            bad_gradients=origin["bad"][:8],
            bad_gradient_count=len(origin["bad"]),
            finding=origin["finding"],
            note=note,
            refused_by=origin["refused_by"],
            refusal=origin["refusal"],
            history=history,
            **({"overflow": True, "dtype": origin.get("dtype")} if origin.get("overflow") else {}),
            **({"deferred": True} if deferred else {}),
            **({"samples": origin["samples"]} if origin.get("samples") is not None else {}),
            **(
                {"placed_by": origin["placed_by"], "what": origin.get("what")}
                if origin.get("placed_by")
                else {}
            ),
        )
