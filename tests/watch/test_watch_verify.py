"""watch(..., verify_inputs=True): non-finite values from nowhere.

An input watch saw produced finite, at the same version, is non-finite when an op reads it: no
op made it. A write outside stream order (a stream race, memory freed too early), or here a
write through a numpy view, which moves no version counter."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

import cublas_guard_ext as cg

watch_module = importlib.import_module("cublas_guard_ext.watching.session")
NonFiniteFromNowhereError = watch_module.NonFiniteFromNowhereError


def _plant_behind_torch(y: torch.Tensor) -> None:
    with torch.no_grad():
        y.detach().numpy()[5] = np.nan  # no dispatcher op, no version bump


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_write_behind_torch_is_named_with_producer_and_reader(mode):
    x = torch.rand(100) + 0.5
    with pytest.raises(NonFiniteFromNowhereError) as info:
        with cg.watch(None, mode=mode, verify_inputs=True):
            y = x * 3.0  # scanned: finite, remembered at its version
            version = y._version
            _plant_behind_torch(y)
            assert y._version == version
            torch.exp(y)  # reads a NaN that no op produced
    err = info.value
    assert isinstance(err, cg.GuardError) and isinstance(err, ValueError)
    assert err.reader == "aten.exp.default" and err.argument == "self"
    assert err.producer == "aten.mul.Tensor"
    assert err.nan_count == 1 and err.first_bad_index == 5 and err.shape == [100]
    assert "no op made these values" in str(err) and "stream" in str(err)


def test_without_verify_the_reader_is_blamed_as_a_producer():
    # what verify_inputs exists for: the stale "finite" makes exp look like the producer
    x = torch.rand(100) + 0.5
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            y = x * 3.0
            _plant_behind_torch(y)
            torch.exp(y)
    assert info.value.op == "aten.exp.default"


def test_verify_inputs_is_silent_on_clean_and_on_ordinary_propagation():
    x = torch.rand(100) + 0.5
    with cg.watch(None, mode="sync", verify_inputs=True, allow=["aten.log"]):
        y = torch.exp(x * 3.0)
        z = torch.log(y - 1000.0)  # NaN born in an op (allowed): not "from nowhere"
        w = z * 2.0  # reads z, known non-finite: a propagator, as without verify
    assert torch.isfinite(y).all() and w.isnan().any()
