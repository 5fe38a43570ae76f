"""watch with threads, nesting, checkpointing, SafeLinear, other dtypes, in-place ops and optimizers."""

from __future__ import annotations

import importlib
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import cublas_guard_ext as cg

from helpers.watch_models import FeedForward, Model, batch, nothing_left

watch_module = importlib.import_module("cublas_guard_ext.watching.session")

# -- threads, nothing left, checkpointing, SafeLinear -----------------------------------


def test_each_thread_gets_its_own_findings():
    results: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def run(name: str, planted: str) -> None:
        model = Model(planted=planted)
        try:
            with cg.watch(model, mode="async"):
                barrier.wait()
                for _ in range(3):
                    model(batch()).backward()
            results[name] = "clean"
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[name] = exc

    threads = [
        threading.Thread(target=run, args=("bad", "log")),
        threading.Thread(target=run, args=("good", "")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["good"] == "clean"
    assert isinstance(results["bad"], cg.NonFiniteOutputError)
    assert results["bad"].module == "layers.1.ff"


def test_nothing_left_registered_after_a_clean_or_a_raising_block():
    model = Model(planted="log")
    before = (len(model._forward_pre_hooks), len(model._forward_hooks))
    for mode in ("sync", "async"):
        with pytest.raises(cg.NonFiniteOutputError):
            with cg.watch(model, mode=mode):
                model(batch())
        nothing_left()
        assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == before
    with pytest.raises(KeyError):
        with cg.watch(Model(), mode="sync"):
            raise KeyError("user error")
    nothing_left()
    torch.log(-torch.rand(3) - 1.0)  # outside a block: nothing is watched


def test_nested_watch_restores_the_outer_one():
    with pytest.raises(cg.NonFiniteOutputError):
        with cg.watch(None, mode="sync"):
            with cg.watch(None, mode="sync", allow=["aten.log"]):
                torch.log(-torch.rand(3) - 1.0)
            torch.log(-torch.rand(3) - 1.0)
    nothing_left()


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    class Checkpointed(nn.Module):
        def __init__(self, planted: str) -> None:
            super().__init__()
            self.ff = FeedForward(16, planted)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.ff, x, use_reentrant=reentrant).sum()

    x = torch.randn(3, 16, requires_grad=True)
    clean = Checkpointed("")
    with cg.watch(clean, mode="sync"):
        clean(x).backward()
    forward_bad = Checkpointed("log")
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(forward_bad, mode="sync"):
            forward_bad(x)
    assert info.value.module == "ff" and info.value.phase == "forward"
    backward_bad = Checkpointed("sqrt")
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(backward_bad, mode="sync"):
            backward_bad(x).backward()
    assert info.value.phase == "backward" and info.value.module == "ff"
    nothing_left()


def test_with_safelinear_in_the_model():
    model = cg.replace_linear(Model(planted="log"))
    assert isinstance(model.layers[1].ff.fc2, cg.SafeLinear)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            model(batch())
    # the watch names the producer before SafeLinear (fc2) sees the NaN input
    assert info.value.op == "aten.log.default" and info.value.module == "layers.1.ff"
    clean = cg.replace_linear(Model())
    with cg.watch(clean, mode="async"):
        clean(batch()).backward()


def test_watch_changes_no_result():
    torch.manual_seed(0)
    model = Model()
    x = batch().requires_grad_()
    loss = model(x)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    x.grad = None
    with cg.watch(model, mode="async") as w:
        loss2 = model(x)
        loss2.backward()
        ops_seen, scanned = w.stats()
    assert torch.equal(loss, loss2)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert ops_seen > 100 and scanned > 50


def test_other_dtypes_are_watched():
    x = torch.rand(8, dtype=torch.float64) + 1.0
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.log(-x)
    assert info.value.dtype == "torch.float64"
    with pytest.raises(cg.NonFiniteOutputError):
        with cg.watch(None, mode="sync"):
            torch.exp(torch.full((4,), 100.0, dtype=torch.bfloat16))  # overflow: +Inf


def test_rank_prefix_under_distributed_env(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.log(-torch.rand(3) - 1.0)
    assert str(info.value).startswith("[rank 1/2] watch: aten.log.default")
    assert info.value.rank == 1


_lib = torch.library.Library("cg_watch_test", "DEF")
_lib.define("log_all_(Tensor(a!)[] xs) -> ()")


def _log_all_(xs):
    # writes behind the dispatcher (a fused kernel would): no inner op to blame
    for x in xs:
        a = x.detach().numpy()
        with np.errstate(invalid="ignore"):
            a[...] = np.log(a)


_lib.impl("log_all_", _log_all_, "CPU")


def test_op_returning_nothing_is_judged_on_the_tensors_it_wrote():
    # ops that return nothing (_foreach_*_, fused optimizers) write their outputs
    # into their arguments: those are scanned (before: not scanned at all)
    xs = [torch.rand(5) + 0.5, -(torch.rand(3) + 0.5)]
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.ops.cg_watch_test.log_all_(xs)
    assert info.value.op == "cg_watch_test.log_all_.default"
    assert info.value.nan_count == 3
    ys = [torch.rand(4) + 0.5]
    with cg.watch(None, mode="sync"):
        torch.ops.cg_watch_test.log_all_(ys)  # clean: nothing raised
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch._foreach_log_([torch.rand(2) + 0.5, -(torch.rand(3) + 0.5)])
    # Named at the foreach op on every device: one fused kernel on CUDA; on the CPU a loop over
    # log_ that watch does not check one by one (the foreach ops are sealed: see watch_ops.cpp)
    assert info.value.op == "aten._foreach_log_.default"
    assert info.value.nan_count == 3 and list(info.value.shape) == [3]


def test_foreach_inplace_propagator_is_not_blamed():
    xs = [torch.tensor([1.0, float("nan")]), torch.rand(3)]
    with cg.watch(None, mode="sync"):
        torch._foreach_mul_(xs, 2.0)  # the NaN was there before the op


def test_every_write_is_seen():
    x = torch.rand(1000) + 0.5
    with cg.watch(None, mode="sync"):
        y = x * 2.0
        y.mul_(3.0)
        y.sub_(10.0)  # finite -> finite, negative now
        with pytest.raises(cg.NonFiniteOutputError) as info:
            y.log_()  # the known "finite" of y is replaced by every write
    assert info.value.op == "aten.log_.default"
    z = torch.rand(10) + 0.5
    with cg.watch(None, mode="sync"):
        z2 = z * 1.0
        z2.data.fill_(float("nan"))  # another version counter, same storage: forgotten
        z2.mul_(2.0)  # NaN before the op: a propagator, not blamed


def test_an_optimizer_step_is_watched_and_raises_nothing():
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(batch()).backward()
    with cg.watch(model, mode="async") as w:
        opt.step()
        ops, scanned = w.stats()
    assert ops > 0 and scanned > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("foreach", [False, True])
def test_optimizer_overflow_is_named(foreach):
    # a huge but finite gradient: grad * grad overflows in Adam's second moment
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    model(batch()).backward()
    with torch.no_grad():
        model.head.weight.grad.fill_(1e30)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            opt.step()
    # torch's own optimizer runs unhooked on every device; its writes are judged when it returns
    assert info.value.op == "cublas_guard_internal.optimizer_step_writes.default"
    assert info.value.state == "exp_avg_sq" and info.value.parameter == "head.weight"
    assert info.value.posinf_count > 0
