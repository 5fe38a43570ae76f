"""The overflow story (errors/overflow.py, guarded_linear/error_hooks.py): a float16 value past 65504 becomes
+Inf, never NaN. watch names the op that overflowed with the numbers that show it; the next
guarded layer, refusing the Inf, says it is most likely an overflow and names the guarded layer
that ran before it; the next steps are a wider dtype, autocast, loss scaling (backward), a
smaller learning rate, never allow=."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext.errors import overflow

FP16_STEPS = (
    "      give {where} more range: bfloat16 has float32's range (largest 3.39e+38) at float16's size "
    "(model.to(torch.bfloat16): GPUs since Ampere, and CPUs), or float32 (for one layer: layer.float(), "
    "its input cast with x.float() and its output back with .half())\n"
    "      or keep the weights in float32 and run under torch.autocast(device_type, dtype=torch.bfloat16) "
    "(float16 autocast keeps matmuls in float16: it would not remove this overflow)\n"
    "      if it began after some training: a smaller learning rate, gradient clipping "
    "(torch.nn.utils.clip_grad_norm_), weight decay: weights and activations that keep growing end past "
    "any range"
)


def overflowing_model() -> nn.Sequential:
    """fc1 (1024 -> 4, weights 0.25) overflows float16 for inputs of 300 (1024 x 300 x 0.25 = 76800
    > 65504); fc2 is the next guarded layer."""
    model = nn.Sequential(nn.Linear(1024, 4), nn.ReLU(), nn.Linear(4, 2)).half()
    with torch.no_grad():
        model[0].weight.fill_(0.25)
        model[0].bias.zero_()
    return cg.replace_linear(model, mode="sync")


X300 = torch.full((2, 1024), 300.0, dtype=torch.float16)


def test_the_next_layer_says_float16_overflowed_and_names_the_layer_before_it():
    model = overflowing_model()
    with pytest.raises(cg.NonFiniteInputError) as info:
        model(X300)
    err = info.value
    assert str(err) == (
        "layer '2': input has 0 NaN, 8 +Inf, 0 -Inf: most likely a float16 overflow before this layer "
        "(Inf alone, no NaN)\n"
        "  first bad element: flat index 0 = x[0, 0] (+Inf)\n"
        "  shape [2, 4], 8 elements\n"
        "  overflow: a value past float16's largest, 65504, becomes +/-Inf (never NaN); none of this "
        "input's values is finite\n"
        "  the guarded layer that ran before it on this thread: '0' (in_features 1024, max|weight| 0.25, "
        "max|bias| 0): its outputs can pass 65504 once its input reaches 255.875 = (65504 - 0) / "
        "(1024 x 0.25); the overflow is in it or in an op between the two\n"
        "  NaN/Inf do not make cuBLAS fail (a GEMM never looks at values: it returns NaN with status "
        "SUCCESS); the guard refuses them so they do not spread.\n"
        "Next: name the op that overflowed: run the step under cublas_guard_ext.watch(model); it reports "
        "the op, its module and its operands' magnitudes\n"
        + FP16_STEPS.format(where="the layer or op that overflowed")
    )
    assert (err.dtype, err.previous_layer, err.previous_in_features) == ("torch.float16", "0", 1024)
    assert (err.previous_weight_absmax, err.previous_bias_absmax, err.finite_absmax) == (0.25, 0.0, 0.0)
    assert "allow=" not in str(err)


def test_the_refused_inputs_finite_values_are_measured():
    model = overflowing_model()
    x = X300.clone()
    x[1] = 0.01  # row 1 stays finite: 1024 x 0.01 x 0.25 = 2.56
    with pytest.raises(cg.NonFiniteInputError) as info:
        model(x)
    assert info.value.finite_absmax == pytest.approx(2.56, rel=1e-3)
    assert "the finite values of this input reach 2.56055 (0% of the range)" in str(info.value)


def test_with_no_guarded_layer_before_it_the_data_is_suspected():
    layer = cg.replace_linear(nn.Sequential(nn.Linear(4, 2))).half()
    x = torch.tensor([[1.0, 2.0, 70000.0, 3.0]]).half()  # a cast past 65504: +Inf
    caught: list[BaseException] = []

    def run() -> None:  # a fresh thread: nothing guarded ran on it before
        try:
            layer(x)
        except BaseException as exc:
            caught.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    (err,) = caught
    assert isinstance(err, cg.NonFiniteInputError) and err.previous_layer is None
    assert (
        "  overflow: a value past float16's largest, 65504, becomes +/-Inf (never NaN); the finite values "
        "of this input reach 3 (0% of the range)\n"
        "  no guarded layer ran before it on this thread: the overflow is in an op before it, or in the "
        "data (values past 65504 cast to float16)\n"
    ) in str(err)


def test_a_nan_or_a_float32_inf_keeps_the_usual_message():
    nan_in = torch.full((2, 1024), 300.0, dtype=torch.float16)
    nan_in[0, 0] = float("nan")
    model = overflowing_model()
    with pytest.raises(cg.NonFiniteInputError) as info:
        model[0](nan_in)
    assert str(info.value).startswith("layer '0': input has 1 NaN, 0 +Inf, 0 -Inf\n")
    assert "overflow" not in str(info.value) and "watch(model)" in str(info.value)
    fp32 = cg.replace_linear(nn.Sequential(nn.Linear(4, 2)))
    with pytest.raises(cg.NonFiniteInputError) as info:
        fp32(torch.tensor([[1.0, float("inf"), 0.0, 0.0]]))
    assert str(info.value).startswith("layer '0': input has 0 NaN, 1 +Inf, 0 -Inf\n")
    assert "overflow" not in str(info.value)


def test_an_inf_gradient_in_float16_points_at_loss_scaling():
    layer = cg.replace_linear(nn.Sequential(nn.Linear(4, 2)), scan_grad=True).half()
    x = torch.randn(3, 4, dtype=torch.float16, requires_grad=True)
    out = layer(x)
    with pytest.raises(cg.NonFiniteInputError) as info:
        out.backward(torch.full_like(out, float("inf")))
    text = str(info.value)
    assert text.startswith(
        "layer '0': grad_output has 0 NaN, 6 +Inf, 0 -Inf: most likely a float16 overflow in the backward "
        "pass (Inf alone, no NaN)\n"
    )
    assert (
        "      gradients past the range: loss scaling (torch.amp.GradScaler) skips the steps whose gradients "
        "overflow and lowers the scale; with a GradScaler already, such an Inf is how it finds its scale: it "
        "matters only if it repeats every step\n"
    ) in text
    assert "the guarded layer that ran before it" not in text


def test_an_async_refusal_reads_the_dtype_from_the_layer():
    model = overflowing_model()
    for layer in (model[0], model[2]):
        layer.mode = "async"
    model(X300)
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    err = info.value
    assert err.deferred and err.dtype == "torch.float16"
    assert str(err).startswith(
        "layer '2', call 1: input has 0 NaN, 8 +Inf, 0 -Inf: most likely a float16 overflow before this layer"
    )
    assert "ran before it on this thread" not in str(err)  # the record is of the call running now


# -- watch: the op that overflowed ------------------------------------------------------------


@pytest.mark.locked  # watch
def test_watch_names_the_guarded_gemm_that_overflowed_with_its_bound():
    model = overflowing_model()
    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(model, mode="sync"):
        model(X300)
    err = info.value
    assert (err.overflow, err.dtype_max, err.overflow_bound) == (True, 65504.0, 76800.0)
    text = str(err)
    assert text.startswith(
        "watch: cublas_guard.linear.default in module '0' (forward) overflowed float16: produced 0 NaN, "
        "8 +Inf, 0 -Inf from finite inputs\n"
    )
    assert (
        "  inputs' absolute maxima: 300, 0.25, 0\n"
        "  overflow: float16's largest value is 65504; each output of this GEMM sums K = 1024 products of "
        "x and weight, so it can reach 1024 x 300 x 0.25 + 0 (max|x| x max|weight| + max|bias|) = 76800: "
        "up to 1.17x past the range\n"
        "  reached: the input of cublas_guard.linear.default, which refused it\n"
        "Next: " + FP16_STEPS.format(where="module '0'").lstrip() + "\n"
    ) in text
    assert "allow=" not in text


@pytest.mark.locked  # watch
def test_watch_explains_an_exp_overflow_and_autocast_helps_there():
    class Exp(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.exp(x)

    model = Exp()
    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(model, mode="sync"):
        model(torch.full((3,), 12.0, dtype=torch.float16))
    text = str(info.value)
    assert (
        "  overflow: float16's largest value is 65504, and this op's result passed it from finite inputs "
        "(exp(v) passes it for v > 11.09)\n"
    ) in text
    assert (
        "(float16 autocast also helps here: it runs exp, sums, softmax, norms and losses in float32)" in text
    )


@pytest.mark.locked  # watch
def test_watch_calls_a_bfloat16_overflow_divergence():
    class Gram(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ x.t()

    model = Gram()
    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(model, mode="sync"):
        model(torch.full((2, 4), 1e20, dtype=torch.bfloat16))
    text = str(info.value)
    assert (
        "overflowed bfloat16" in text
        and "each output of this GEMM sums K = 4 products of self and mat2" in text
    )
    assert (
        "Next: bfloat16 already has float32's range (largest 3.39e+38): values past it mean the computation "
        "diverged, not that the dtype is too small\n"
    ) in text


@pytest.mark.locked  # watch
def test_a_pole_is_not_called_an_overflow():
    class Log(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x)

    model = Log()
    with pytest.raises(cg.NonFiniteOutputError) as info, cg.watch(model, mode="sync"):
        model(torch.zeros(3, dtype=torch.float16))
    assert info.value.overflow is None and "overflow:" not in str(info.value)
    assert "likely a log of a negative number (NaN) or of zero (-Inf)" in str(info.value)


# -- the rules, from plain fields --------------------------------------------------------------


def test_gemm_bounds_read_k_from_each_ops_operands():
    addmm = {
        "op": "aten.addmm.default",
        "input_names": ["self", "mat1", "mat2"],
        "input_shapes": [[4], [2, 8], [8, 4]],
        "input_absmax": [1.0, 100.0, 90.0],
    }
    assert overflow.gemm_bound(addmm)["bound"] == 8 * 100.0 * 90.0 + 1.0
    grad_weight = {
        "op": "cublas_guard.linear_grad_weight.default",
        "input_names": ["grad_output", "x"],
        "input_shapes": [[3, 5, 4], [3, 5, 8]],
        "input_absmax": [2.0, 3.0],
    }
    assert overflow.gemm_bound(grad_weight)["k"] == 15  # dW sums over the 3 x 5 rows
    assert overflow.gemm_bound({"op": "aten.add.Tensor"}) is None


def test_a_gemm_whose_bound_fits_is_not_called_an_overflow():
    fields = {
        "op": "aten.mm.default",
        "dtype": "torch.float16",
        "nan_count": 0,
        "posinf_count": 1,
        "neginf_count": 0,
        "input_names": ["self", "mat2"],
        "input_shapes": [[2, 4], [4, 2]],
        "input_absmax": [10.0, 10.0],  # 4 x 10 x 10 = 400: the Inf came from elsewhere
    }
    assert overflow.finding_overflow(fields) is None
    assert overflow.finding_overflow({**fields, "input_absmax": [200.0, 200.0]}) == {
        "overflow": True,
        "dtype_max": 65504.0,
        "overflow_bound": 160000.0,
    }
    assert overflow.finding_overflow({**fields, "nan_count": 1, "input_absmax": [200.0, 200.0]}) is None
    assert (
        overflow.finding_overflow({**fields, "dtype": "torch.float32", "input_absmax": [2e19, 2e19]}) is None
    )
