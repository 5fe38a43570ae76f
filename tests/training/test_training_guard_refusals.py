"""TrainingGuard with guarded layers inside the step, and a run that diverges: a SafeLinear's
refusal is a non-finite step (replayed, nothing applied, skipped or raised with the layer's
error as the cause); N skipped steps in a row raise TrainingDivergedError with the loss and
gradient-norm history."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg

NAN = float("nan")


class InfGrad(torch.autograd.Function):
    """Identity forward; an Inf gradient in backward (what scan_grad's check sees)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / torch.zeros_like(grad)


class GradFault(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x):
        return InfGrad.apply(x) if self.on else x


def guarded_model(seed: int = 0, scan_grad: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), GradFault(), nn.Linear(16, 1))
    return cg.replace_linear(model, scan_grad=scan_grad)


def batches(n: int, nan_at: int | None = None, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(1, n + 1):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)
        if i == nan_at:
            x[2, 5] = NAN  # one NaN in the batch
        out.append((x, y))
    return out


def closure_for(model, optimizer, batch):
    def closure():
        optimizer.zero_grad()
        x, y = batch
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


def state(model, optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(optimizer.state.values()):
        for k, v in s.items():
            out[f"opt.{i}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    out["rng.cpu"] = torch.get_rng_state()
    return out


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def train(model, optimizer, data, guard=None):
    losses = []
    for batch in data:
        closure = closure_for(model, optimizer, batch)
        if guard is None:
            losses.append(closure())
            optimizer.step()
        else:
            losses.append(guard.step(closure))
    return losses


# -- a SafeLinear's refusal inside the step ---------------------------------------------------


def test_the_issue_reproducer_skips_the_nan_batch_and_trains_on():
    model = guarded_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = cg.TrainingGuard(model, optimizer, on_nan="skip")
    with pytest.warns(RuntimeWarning, match=r"training step 3: layer '0' refused a non-finite input"):
        losses = train(model, optimizer, batches(5, nan_at=3), guard)
    assert losses[2] is None and all(isinstance(v, torch.Tensor) for i, v in enumerate(losses) if i != 2)
    (err,) = guard.skipped
    assert isinstance(err, cg.NonFiniteStepError) and err.step == 3 and err.refused_by == "0"
    assert isinstance(err.__cause__, cg.NonFiniteInputError) and err.__cause__.layer == "0"
    assert err.classification == "persistent" and err.loss is None
    assert err.refusal == {
        "error": "NonFiniteInputError",
        "role": "input",
        "nan_count": 1,
        "posinf_count": 0,
        "neginf_count": 0,
        "dtype": "torch.float32",
    }


def test_skipping_a_refused_batch_equals_a_run_without_it_bitwise():
    data = batches(5, nan_at=3)
    m1 = guarded_model()
    m2 = copy.deepcopy(m1)
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    guard = cg.TrainingGuard(m1, o1, on_nan="skip")
    with pytest.warns(RuntimeWarning):
        train(m1, o1, data, guard)
    train(m2, o2, data[:2] + data[3:])
    assert_bitwise(state(m1, o1), state(m2, o2))


def test_raise_gives_a_step_error_caused_by_the_layer_error_and_applies_nothing():
    model = guarded_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = cg.TrainingGuard(model, optimizer, on_nan="raise")
    data = batches(3, nan_at=3)
    train(model, optimizer, data[:2], guard)
    before = state(model, optimizer)
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure_for(model, optimizer, data[2]))
    err = info.value
    assert isinstance(err.__cause__, cg.NonFiniteInputError) and err.refused_by == "0"
    assert err.step == 3 and err.classification == "persistent"
    assert "layer '0' refused a non-finite input (NaN 1, +Inf 0, -Inf 0)" in str(err)
    assert "loss: not computed" in str(err)
    assert_bitwise(state(model, optimizer), before)
    assert all(p.grad is None for p in model.parameters())


def test_a_refusal_in_backward_scan_grad_is_a_skipped_step_with_nothing_applied():
    data = batches(4)
    m1 = guarded_model(scan_grad=True)
    m2 = copy.deepcopy(m1)
    o1 = torch.optim.SGD(m1.parameters(), lr=1e-2, momentum=0.9)
    o2 = torch.optim.SGD(m2.parameters(), lr=1e-2, momentum=0.9)
    guard = cg.TrainingGuard(m1, o1, on_nan="skip")
    train(m1, o1, data[:2], guard)
    m1[3].on = True  # the gradient arriving at layer '2' is Inf: its backward scan refuses it
    with pytest.warns(RuntimeWarning, match="refused a non-finite grad_output"):
        assert guard.step(closure_for(m1, o1, data[2])) is None
    m1[3].on = False
    train(m1, o1, data[3:], guard)
    train(m2, o2, data[:2] + data[3:])
    (err,) = guard.skipped
    assert err.refused_by == "2" and err.refusal["role"] == "grad_output"
    assert isinstance(err.__cause__, cg.NonFiniteInputError)
    assert_bitwise(state(m1, o1), state(m2, o2))


def test_other_guard_errors_are_bugs_and_propagate_unchanged():
    model = guarded_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = cg.TrainingGuard(model, optimizer, on_nan="skip")

    def closure():
        return model(torch.randn(2, 7)).sum()  # wrong width

    with pytest.raises(cg.ShapeMismatchError):
        guard.step(closure)
    assert guard.skipped == []


# -- history and divergence ----------------------------------------------------------------------


def diverging_run(max_consecutive_skips=3, steps: int = 30):
    """The issue's blow-up: SGD lr=1e3 on a small MSE model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e3)
    guard = cg.TrainingGuard(model, optimizer, on_nan="skip", max_consecutive_skips=max_consecutive_skips)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(steps)]
    return model, optimizer, guard, data


@pytest.mark.locked
def test_sgd_lr_1e3_raises_training_diverged_after_three_skipped_steps_with_the_history():
    model, optimizer, guard, data = diverging_run()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(cg.TrainingDivergedError) as info:
            train(model, optimizer, data, guard)
    err = info.value
    assert isinstance(err, cg.NonFiniteStepError)  # caught where a bad step is caught
    assert err.consecutive_skips == 3 and err.skipped_steps == [3, 4, 5] and err.step == 5
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 2  # steps 3 and 4
    history = err.history
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5]
    assert [h["skipped"] for h in history] == [False, False, True, True, True]
    assert 0.1 < history[0]["loss"] < 10 and history[1]["loss"] > 1e8  # the blow-up before the Inf
    assert history[1]["grad_norm"] > 1e6 and all(not math.isfinite(h["loss"]) for h in history[2:])
    assert err.param_absmax > 1e9 and err.param_absmax_name is not None
    text = str(err)
    assert text.startswith("training diverged: 3 consecutive steps (steps 3-5)")
    assert "recent steps (loss, gradient norm):" in text and "step 2: loss 3.291e+09" in text
    assert "parameters' absolute maximum: " in text and "lower the learning rate" in text
    assert isinstance(err.__cause__, cg.NonFiniteOutputError)  # the replay's finding
    assert guard.consecutive_skips == 0  # counted afresh if the caller goes on


def test_max_consecutive_skips_is_configurable_and_none_never_escalates():
    model, optimizer, guard, data = diverging_run(max_consecutive_skips=5)
    with pytest.warns(RuntimeWarning), pytest.raises(cg.TrainingDivergedError) as info:
        train(model, optimizer, data, guard)
    assert info.value.skipped_steps == [3, 4, 5, 6, 7]
    model, optimizer, guard, data = diverging_run(max_consecutive_skips=None)
    with pytest.warns(RuntimeWarning):
        train(model, optimizer, data, guard)
    assert len(guard.skipped) == 28


def test_a_healthy_step_resets_the_count_of_skipped_steps():
    model = guarded_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = cg.TrainingGuard(model, optimizer, on_nan="skip", max_consecutive_skips=2)
    pattern = batches(6, nan_at=2)
    pattern[3] = batches(6, nan_at=4)[3]
    with pytest.warns(RuntimeWarning):
        train(model, optimizer, pattern, guard)  # bad, good, bad, ...: never two in a row
    assert [e.step for e in guard.skipped] == [2, 4]


def test_the_step_error_shows_the_recent_history_and_history_zero_turns_it_off():
    model = guarded_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = cg.TrainingGuard(model, optimizer, on_nan="skip", history=3)
    with pytest.warns(RuntimeWarning):
        train(model, optimizer, batches(5, nan_at=5), guard)
    (err,) = guard.skipped
    assert [h["step"] for h in err.history] == [3, 4, 5]
    assert err.history[-1] == {"step": 5, "loss": None, "grad_norm": None, "skipped": True, "refused_by": "0"}
    assert all(h["loss"] > 0 and h["grad_norm"] > 0 for h in err.history[:2])
    guard = cg.TrainingGuard(model, optimizer, on_nan="skip", history=0)
    with pytest.warns(RuntimeWarning):
        train(model, optimizer, batches(2, nan_at=2), guard)
    assert guard.skipped[0].history == [] and "recent steps" not in str(guard.skipped[0])


def test_the_gradient_norm_is_the_global_2_norm():
    model = guarded_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = cg.TrainingGuard(model, optimizer, on_nan="skip")
    (batch,) = batches(1)
    guard.step(closure_for(model, optimizer, batch))
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    (entry,) = guard._history.read()
    assert entry["grad_norm"] == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_consecutive_skips": 0}, "max_consecutive_skips must be a positive int"),
        ({"max_consecutive_skips": True}, "max_consecutive_skips must be a positive int"),
        ({"max_consecutive_skips": 2.0}, "max_consecutive_skips must be a positive int"),
        ({"history": -1}, r"history must be an int >= 0"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    model = guarded_model()
    with pytest.raises(ValueError, match=match):
        cg.TrainingGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_help_shows_a_real_docstring_whose_example_output_is_the_real_output():
    doc = cg.TrainingGuard.__doc__
    assert "see the module docstring" not in doc.lower().splitlines()[0]
    for argument in (
        "model",
        "optimizer",
        "on_nan",
        "max_consecutive_skips",
        "history",
        "scaler",
        "deferred",
    ):
        assert f"``{argument}``" in doc, argument
    assert "Costs:" in doc and "Example" in doc
    # the example, run: its message is the docstring's, line for line
    torch.manual_seed(0)
    model = cg.replace_linear(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = cg.TrainingGuard(model, opt, on_nan="raise")
    x, y = torch.randn(4, 8), torch.randn(4, 1)

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    assert repr(guard.step(closure)) in doc
    x[1, 3] = NAN
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure)
    lines = str(info.value).splitlines()
    assert f"NonFiniteStepError: {lines[0]}" in doc
    for line in lines[1:]:
        if not line.strip().startswith(("replayed under watch:", "finding:")):  # watch's own words
            assert line.strip() in doc, line


def test_every_documented_field_exists_on_every_instance():
    model, optimizer, guard, data = diverging_run()
    with pytest.warns(RuntimeWarning), pytest.raises(cg.TrainingDivergedError) as info:
        train(model, optimizer, data, guard)
    step_fields = (
        "step loss module op phase classification rank world_size bad_gradients bad_gradient_count "
        "finding note refused_by refusal history"
    ).split()
    diverged_fields = "consecutive_skips skipped_steps param_absmax param_absmax_name param_dtype".split()
    for err in [*guard.skipped, info.value]:
        for name in step_fields:
            getattr(err, name)  # None when not known, never AttributeError
        assert err.rank is None and err.world_size is None and err.refused_by is None
    for name in diverged_fields:
        getattr(info.value, name)
    for name in step_fields + diverged_fields:
        assert f"``{name}``" in (cg.NonFiniteStepError.__doc__ + cg.TrainingDivergedError.__doc__), name


@pytest.mark.locked  # the replay names the op under watch
def test_a_float16_overflow_in_the_step_gets_the_overflow_next_steps():
    model = nn.Sequential(nn.Linear(64, 4), nn.ReLU(), nn.Linear(4, 1)).half()
    with torch.no_grad():
        model[0].weight.fill_(8.0)  # 64 x 200 x 8 = 102400 > 65504
        model[0].bias.zero_()
    cg.replace_linear(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = cg.TrainingGuard(model, optimizer, on_nan="raise")
    x, y = torch.full((2, 64), 200.0, dtype=torch.float16), torch.zeros(2, 1, dtype=torch.float16)
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure_for(model, optimizer, (x, y)))
    err = info.value
    assert err.refused_by == "2" and err.refusal["dtype"] == "torch.float16"
    assert (err.op, err.module, err.overflow, err.dtype) == (
        "cublas_guard.linear.default",
        "0",
        True,
        "torch.float16",
    )
    assert "replayed under watch: cublas_guard.linear.default in module '0' (forward) produced it" in str(err)
    assert (
        str(err)
        .split("\nNext: ")[1]
        .startswith(
            "give module '0' more range: bfloat16 has float32's range (largest 3.39e+38) at float16's size"
        )
    )
    assert "look at the batch" not in str(err)
