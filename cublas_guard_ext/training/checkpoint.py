"""``guard.state_dict()`` / ``guard.load_state_dict()``: what a resumed run needs to judge its
steps as the original would have.

Kept: the step count (the numbers in messages and in the skip list, ``check_every``'s
schedule), the consecutive-skip count and the skip counters (``scaler_skips``,
``list_skips``, the steps ``on_nan="skip"`` dropped), the loss and gradient-norm history the
messages show, and the spike detector's window (values, position, fill) so the first steps
after a resume are judged against the same medians. Plain Python values and one CPU tensor:
``torch.save`` it with the model and optimizer, or put it in a DCP / Lightning / HF Trainer
checkpoint (docs/training-guard.md shows each). Not kept: the skip list (its file is the
record, re-read when the guard is built) and ``guard.skipped``'s error objects (their step
numbers are).
"""

from __future__ import annotations

import json
from typing import Any

import torch

__all__ = ["state_dict", "load_state_dict"]

VERSION = 1


def state_dict(guard: Any) -> dict[str, Any]:
    """Ints and JSON strings only: the same keys whatever the run did, so a fresh guard's
    state_dict is a template torch.distributed.checkpoint can load into (it loads by key)."""
    spikes = _spikes(guard)
    saved_spikes = None
    if spikes is not None:
        saved_spikes = {
            "values": spikes.values.detach().cpu().tolist() if spikes.values is not None else None,
            "pos": spikes.pos,
            "filled": spikes.filled,
            "window": spikes.window,
        }
    return {
        "version": VERSION,
        "steps": guard.steps,
        "consecutive_skips": guard.consecutive_skips,
        "scaler_skips": guard.scaler_skips,
        "list_skips": guard.list_skips,
        "skipped_steps": json.dumps([e.fields.get("step") for e in guard.skipped]),
        "history": json.dumps(guard.history.read()),
        "spikes": json.dumps(saved_spikes),
    }


def _spikes(guard: Any) -> Any:
    checks = guard.silent_corruption
    return checks.spikes if checks is not None else None


def load_state_dict(guard: Any, state: dict[str, Any]) -> None:
    if not isinstance(state, dict) or state.get("version") != VERSION:
        got = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"TrainingGuard.load_state_dict: expected a TrainingGuard state (version {VERSION}) "
            f"from guard.state_dict(), got version {got!r}"
        )
    guard.steps = int(state["steps"])
    guard.consecutive_skips = int(state["consecutive_skips"])
    guard.scaler_skips = int(state["scaler_skips"])
    guard.list_skips = int(state["list_skips"])
    guard.restored_skipped_steps = json.loads(state["skipped_steps"])
    guard.history.load(json.loads(state["history"]))
    saved = json.loads(state["spikes"])
    spikes = _spikes(guard)
    if saved is None or spikes is None:
        return
    if saved["window"] != spikes.window:
        raise ValueError(
            f"TrainingGuard.load_state_dict: the saved spike window has {saved['window']} steps, this "
            f"guard's SilentCorruptionChecks(spike_window={spikes.window}); build it with "
            f"spike_window={saved['window']} to resume the same judgement"
        )
    values = saved["values"]
    if values is not None:
        p = next(iter(guard.inner.parameters()), None)
        p = p.to_local() if p is not None and hasattr(p, "to_local") else p
        device = p.device if p is not None else torch.device("cpu")
        values = torch.tensor(values, dtype=torch.float32, device=device)  # float32 -> float -> exact
    spikes.values, spikes.pos, spikes.filled = values, int(saved["pos"]), int(saved["filled"])
