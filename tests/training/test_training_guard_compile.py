"""TrainingGuard on a torch.compile'd model: guarded, and the replay names the op and module
(aot_eager keeps the ops; inductor fuses them, so the replay runs the model eagerly)."""

from __future__ import annotations

import pytest
import test_training_guard as tg
import torch

import cublas_guard_ext as cg


def _bad_step_under(compile_model) -> tuple[bool, cg.NonFiniteStepError]:
    """Two healthy guarded steps of the compiled model (whether the last one stepped), then one
    whose forward logs a negative (its error)."""
    torch._dynamo.reset()
    model, optimizer = tg.setup()
    compiled = compile_model(model)
    guard = cg.TrainingGuard(compiled, optimizer)
    data = tg.batches(3)
    try:
        for b in data[:2]:
            guard.step(tg.closure_for(compiled, optimizer, b))
        stepped = guard.stepped
        model.act.mode = "log"
        with pytest.raises(cg.NonFiniteStepError) as info:
            guard.step(tg.closure_for(compiled, optimizer, data[2]))
    finally:
        model.act.mode = ""
        torch._dynamo.reset()
    return stepped, info.value


@pytest.mark.slow
@pytest.mark.locked  # the replay names ops through watch, which the core alone lacks
def test_compiled_model_is_guarded_and_the_replay_names_modules():
    stepped, err = _bad_step_under(lambda m: torch.compile(m, backend="aot_eager"))
    assert stepped
    assert err.op == "aten.log.default" and err.module == "act" and err.classification == "persistent"


@pytest.mark.slow
@pytest.mark.locked
def test_inductor_compiled_model_replays_eagerly_so_watch_names_the_op():
    # inductor fuses the ops into its own kernels, which watch cannot see: the replay runs the
    # model eagerly (torch.compiler.set_stance("force_eager")); without that nothing is named
    # (checked). ~30 s here, most of it inductor's CPU compile.
    _, err = _bad_step_under(torch.compile)
    assert err.op == "aten.log.default" and err.module == "act" and err.classification == "persistent"
