"""TrainingGuard on a torch.compile'd model: guarded, and the replay names the op and module
(aot_eager keeps the ops; inductor fuses them, so the replay runs the model eagerly)."""

from __future__ import annotations

import pytest
import test_training_guard as tg
import torch

import cublas_guard_ext as cg


@pytest.mark.slow
@pytest.mark.locked  # the replay names ops through watch, which the core alone lacks
def test_compiled_model_is_guarded_and_the_replay_names_modules():
    torch._dynamo.reset()
    model, optimizer = tg.setup()
    compiled = torch.compile(model, backend="aot_eager")
    guard = cg.TrainingGuard(compiled, optimizer)
    data = tg.batches(3)
    for b in data[:2]:
        guard.step(tg.closure_for(compiled, optimizer, b))
    assert guard.stepped
    model.act.mode = "log"
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(tg.closure_for(compiled, optimizer, data[2]))
    model.act.mode = ""
    err = info.value
    assert err.op == "aten.log.default" and err.module == "act" and err.classification == "persistent"
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_compiled_model_replays_eagerly_so_watch_names_the_op():
    # inductor fuses the ops into its own kernels, which watch cannot see: the replay runs the
    # model eagerly (torch.compiler.set_stance("force_eager")); without that nothing is named
    # (checked). ~30 s here, most of it inductor's CPU compile.
    torch._dynamo.reset()
    model, optimizer = tg.setup()
    compiled = torch.compile(model)
    guard = cg.TrainingGuard(compiled, optimizer)
    data = tg.batches(3)
    for b in data[:2]:
        guard.step(tg.closure_for(compiled, optimizer, b))
    model.act.mode = "log"
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(tg.closure_for(compiled, optimizer, data[2]))
    model.act.mode = ""
    err = info.value
    assert err.op == "aten.log.default" and err.module == "act" and err.classification == "persistent"
    torch._dynamo.reset()
