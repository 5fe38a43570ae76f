"""TrainingGuard knows the batch: ``guard.step(closure, sample_ids=ids)`` names the culprit
samples of a bad step (input rows, the rows of the op watch names, micro-batches), says when
rows cannot be mapped, and refuses ids that cannot name the rows."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg
from cublas_guard_ext.errors.samples import SampleIdsError

IDS = [100, 101, 102, 103, 104, 105]


class RowInfGrad(torch.autograd.Function):
    """Identity forward; backward divides row ``row`` of the gradient by zero."""

    @staticmethod
    def forward(ctx, x, row):
        ctx.row = row
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        scale = torch.ones(grad.shape[0], 1)
        scale[ctx.row] = 0.0
        return grad / scale, None


class RowFault(nn.Module):
    """``row`` set: NaN in that row only ("log": forward, log of -1; "grad": backward only;
    "all": every row)."""

    def __init__(self) -> None:
        super().__init__()
        self.row: int | None = None
        self.mode = "log"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "all":
            return x + torch.log(-x.abs() - 1.0)
        if self.row is None:
            return x
        if self.mode == "grad":
            return RowInfGrad.apply(x, self.row)
        sign = torch.ones(x.shape[0], 1)
        sign[self.row] = -1.0
        return x + torch.log(sign)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = RowFault()
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(torch.relu(self.fc1(x))))


def setup():
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def data(rows: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 1, generator=g)


def closure_for(model, opt, x, y):
    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


def bad_step(model, opt, x, y, ids=IDS, **kw) -> cg.NonFiniteStepError:
    guard = cg.TrainingGuard(model, opt, on_nan="raise")
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure_for(model, opt, x, y), sample_ids=ids, **kw)
    return info.value


# -- naming the culprit --------------------------------------------------------------------


def test_a_nan_input_row_names_that_sample_only():
    model, opt = setup()
    x, y = data()
    x[2, 5] = float("nan")
    err = bad_step(model, opt, x, y)
    s = err.samples
    assert s["ids"] == [102] and s["rows"] == [2] and s["mapped"] and s["batch"] == 6
    assert "samples: 102 (row 2 of 6; the model's argument 'x' holds NaN/Inf in these rows on entry)" in str(
        err
    )
    assert "drop sample 102 from the data" in str(err)


def test_a_tensor_of_ids_and_several_bad_rows():
    model, opt = setup()
    x, y = data()
    x[1, 0] = float("inf")
    x[4, 7] = float("nan")
    err = bad_step(model, opt, x, y, ids=torch.arange(200, 206))
    assert err.samples["ids"] == [201, 204] and err.samples["rows"] == [1, 4]


@pytest.mark.locked  # watch places it: it needs the version-locked library
def test_a_nan_born_in_a_module_names_the_rows_of_its_output():
    model, opt = setup()
    model.act.row = 3
    x, y = data()
    err = bad_step(model, opt, x, y)
    assert err.module == "act" and err.phase == "forward"
    assert err.samples["ids"] == [103]
    assert "of the output of module 'act' (forward)" in err.samples["where"]


@pytest.mark.locked  # watch places it: it needs the version-locked library
def test_a_nan_born_in_backward_names_the_rows_of_the_gradient():
    model, opt = setup()
    model.act.row, model.act.mode = 4, "grad"
    x, y = data()
    err = bad_step(model, opt, x, y)
    assert err.phase == "backward" and err.samples["ids"] == [104], str(err)
    assert "the row of the first bad element of the op watch named" in err.samples["where"]


def test_micro_batches_map_rows_through_their_offsets():
    model, opt = setup()
    x, y = data()
    x[4, 1] = float("nan")  # row 1 of the second micro-batch of 3

    def closure():
        opt.zero_grad()
        total = 0.0
        for part in (slice(0, 3), slice(3, 6)):
            loss = F.mse_loss(model(x[part]), y[part]) / 2
            loss.backward()
            total = total + loss.detach()
        return total

    guard = cg.TrainingGuard(model, opt)
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure, sample_ids=IDS)
    assert info.value.samples["ids"] == [104]


def test_every_row_bad_says_the_culprit_cannot_be_told_apart():
    model, opt = setup()
    model.act.mode = "all"
    x, y = data()
    err = bad_step(model, opt, x, y)
    assert err.samples["ids"] == IDS
    assert "cannot be told apart" in err.samples["note"]


def test_no_leading_batch_dimension_says_rows_cannot_be_mapped():
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 6, 8)  # sequence first: 5 steps of a batch of 6
    x[2, 3, 0] = float("nan")

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    guard = cg.TrainingGuard(model, opt)
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure, sample_ids=IDS)
    s = info.value.samples
    assert not s["mapped"] and s["ids"] == []
    assert "its dimension 1, not the leading one, has one entry per id" in s["note"]
    assert "samples: none named (rows cannot be mapped" in str(info.value)
    # batch= names the rows explicitly: the batch-first view of the same data
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.step(closure, sample_ids=IDS, batch=x.transpose(0, 1))
    assert info.value.samples["ids"] == [103]


def test_healthy_steps_with_ids_equal_steps_without_bitwise():
    m1, o1 = setup()
    m2, o2 = setup()
    g1, g2 = cg.TrainingGuard(m1, o1), cg.TrainingGuard(m2, o2)
    for seed in range(4):
        x, y = data(seed=seed)
        a = g1.step(closure_for(m1, o1, x, y), sample_ids=IDS)
        b = g2.step(closure_for(m2, o2, x, y))
        assert torch.equal(a, b)
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert not m1._forward_pre_hooks  # the capture's hook is gone after the step


# -- ids that cannot name the rows -----------------------------------------------------------


@pytest.mark.parametrize(
    "ids, message",
    [
        (
            [1, 2, 3, 4, 5],
            "sample_ids has 5 ids, but the batch at the model's entry has 6 rows (its argument 'x' has shape (6, 8))",
        ),
        ([1, 2, 2.5, 4, 5, 6], "sample_ids must hold integers; element 2 is 2.5 (float)"),
        ([1, 2, 3, 1, 5, 6], "sample_ids holds 1 more than once (rows 0, 3): each row needs its own id"),
        ([True, 2, 3, 4, 5, 6], "sample_ids must hold integers; element 0 is True (bool)"),
        (
            torch.ones(6),
            "sample_ids must be a list of ints or a 1-D integer tensor, got a torch.float32 tensor",
        ),
        (
            torch.zeros(2, 3, dtype=torch.long),
            "sample_ids must be 1-D (one id per row of the batch), got shape (2, 3)",
        ),
        ([], "sample_ids is empty"),
        ("abcdef", "sample_ids must be a list of ints or a 1-D integer tensor, got str"),
    ],
)
def test_bad_sample_ids_are_refused_with_the_exact_error(ids, message):
    model, opt = setup()
    before = [p.detach().clone() for p in model.parameters()]
    guard = cg.TrainingGuard(model, opt)
    x, y = data()
    with pytest.raises(SampleIdsError) as info:
        guard.step(closure_for(model, opt, x, y), sample_ids=ids)
    assert f"TrainingGuard.step (step 1): {message}" in str(info.value)
    assert guard.steps == 0 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_batch_of_the_wrong_length_is_refused_before_the_closure_runs():
    model, opt = setup()
    guard = cg.TrainingGuard(model, opt)
    calls = []
    with pytest.raises(
        SampleIdsError, match=r"sample_ids has 6 ids, but the batch at the model's entry has 4 rows"
    ):
        guard.step(lambda: calls.append(1), sample_ids=IDS, batch=torch.zeros(4, 8))
    with pytest.raises(SampleIdsError, match="batch= was given without sample_ids"):
        guard.step(lambda: calls.append(1), batch=torch.zeros(6, 8))
    assert calls == [] and guard.steps == 0


def test_numpy_ids_are_accepted():
    np = pytest.importorskip("numpy")
    model, opt = setup()
    x, y = data()
    x[0, 0] = float("nan")
    err = bad_step(model, opt, x, y, ids=np.arange(6, dtype=np.int64) + 7)
    assert err.samples["ids"] == [7]


def test_skip_without_ids_is_unchanged():
    model, opt = setup()
    x, y = data()
    x[0, 0] = float("nan")
    guard = cg.TrainingGuard(model, opt, on_nan="skip")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert guard.step(closure_for(model, opt, x, y)) is None
    assert "samples:" not in str(seen[0].message) and "samples" not in guard.skipped[0].fields


def test_a_healthy_step_with_ids_and_a_skip_list_reads_the_device_once(monkeypatch, tmp_path):
    model, opt = setup()
    guard = cg.TrainingGuard(model, opt, skip_list=tmp_path / "skip.jsonl")
    guard.skip_list.add(list(range(1000, 2000)))  # listed, none in the batch
    x, y = data()
    closure = closure_for(model, opt, x, y)
    guard.step(closure, sample_ids=IDS)  # (warm-up)
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _o=original, _n=name, **k):
            reads.append(_n)
            return _o(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    guard.step(closure, sample_ids=list(range(100, 106)))
    assert reads == ["item"] and guard.stepped  # the flag's one read; ids and lookup on the host
    reads.clear()
    guard.step(closure, sample_ids=torch.arange(200, 206))  # a CPU tensor: read on the host, no sync
    assert reads == ["tolist", "item"]


def test_a_deferred_bad_step_names_its_samples_when_read():
    model, _ = setup()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = cg.TrainingGuard(model, opt, deferred=True)
    x, y = data()
    x[3, 1] = float("nan")
    guard.step(closure_for(model, opt, x, y), sample_ids=IDS)
    with pytest.raises(cg.NonFiniteStepError) as info:
        guard.check()  # the replay runs here, one step later, with that step's batch
    assert info.value.deferred and info.value.samples["ids"] == [103]
