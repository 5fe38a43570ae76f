"""torch.ao's eager-mode quantization and guarded layers (cublas_guard_ext/guarded_linear/ao_quantization.py):
the passes match nn.Linear by its exact type and leave SafeLinear float; the user is told once per
model, with the layers left and the way out (restore_linear first), and that way out quantizes."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cublas_guard_ext as cg

LEFT = (
    "torch.ao.quantization matches nn.Linear by its exact type, so it left 2 guarded layer(s) "
    "unquantized, in float: '0', '2.0'. To quantize them, swap them back first: model = "
    "cublas_guard_ext.restore_linear(model), then quantize (the quantized layers run int8 kernels, not "
    "cuBLAS GEMMs: the guard has nothing to check there). To keep them guarded and float, leave them out "
    "of the qconfig (or ignore this warning)."
)


def guarded() -> nn.Module:
    return cg.replace_linear(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4))))


def ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "guarded layer(s)" in str(w.message)]


@pytest.mark.parametrize("spec", [None, {nn.Linear}], ids=["default-spec", "linear-spec"])
def test_quantize_dynamic_says_once_which_layers_it_left(spec):
    model = guarded()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantized = torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8)
    assert ours(caught) == [LEFT]
    (warning,) = [w for w in caught if "guarded layer(s)" in str(w.message)]
    assert warning.category is UserWarning and warning.filename == __file__  # the user's line
    assert isinstance(quantized[0], cg.SafeLinear)  # what it says: left, float


def test_restore_linear_first_quantizes_every_layer_without_a_word():
    torch.manual_seed(0)
    model = guarded()
    x = torch.randn(3, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantized = torch.ao.quantization.quantize_dynamic(
            cg.restore_linear(copy.deepcopy(model)), {nn.Linear}, dtype=torch.qint8
        )
    assert ours(caught) == []
    assert all("quantized" in type(m).__module__ for m in (quantized[0], quantized[2][0]))
    torch.testing.assert_close(quantized(x), model(x), rtol=0.05, atol=0.05)


def test_static_prepare_says_it_too():
    model = guarded()
    model.qconfig = torch.ao.quantization.get_default_qconfig("fbgemm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.ao.quantization.prepare(model)
    assert ours(caught) == [LEFT]


def test_a_pass_that_did_not_ask_for_linear_or_a_qconfig_set_by_hand_says_nothing():
    model = guarded()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.ao.quantization.quantize_dynamic(model, {nn.LSTM}, dtype=torch.qint8)
        model[0].qconfig = torch.ao.quantization.default_dynamic_qconfig
    assert ours(caught) == []


def test_qconfig_behaves_as_a_plain_attribute():
    layer = cg.SafeLinear(4, 2)
    assert not hasattr(layer, "qconfig")
    layer.qconfig = None
    assert layer.qconfig is None and "qconfig" in layer.__dict__
    del layer.qconfig
    assert not hasattr(layer, "qconfig")
    with pytest.raises(AttributeError):
        del layer.qconfig
    layer.qconfig = "kept"
    plain = cg.restore_linear(layer)
    assert type(plain) is nn.Linear and plain.qconfig == "kept"
    torch.jit.script(cg.SafeLinear(4, 2))  # the property is not compiled
