"""watch(): the op and module that first produced NaN/Inf, forward and backward (issue 13)."""

from __future__ import annotations

import importlib
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import cublas_guard_ext as cg

watch_module = importlib.import_module("cublas_guard_ext.watch")


class FeedForward(nn.Module):
    def __init__(self, width: int, planted: str = "") -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.planted = planted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if self.planted == "log":
            h = torch.log(h - 100.0)  # log of a negative number: NaN, from finite inputs
        elif self.planted == "sqrt":
            h = torch.sqrt(torch.relu(h) * 0.0)  # sqrt(0) = 0: finite forward, Inf gradient
        elif self.planted == "log_":
            h = (h - 100.0).log_()
        return self.fc2(h)


class Attention(nn.Module):
    """Scores with an additive causal -inf mask built inside forward, masked_fill, softmax."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        t = x.shape[1]
        causal = torch.full((t, t), float("-inf")).triu(1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + causal
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        return F.softmax(scores, dim=-1) @ v


class Block(nn.Module):
    def __init__(self, width: int, planted: str = "") -> None:
        super().__init__()
        self.attn = Attention(width)
        self.norm = nn.LayerNorm(width)
        self.ff = FeedForward(width, planted)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x), pad)
        return x + self.ff(self.norm(x))


class Model(nn.Module):
    def __init__(self, width: int = 16, planted: str = "", planted_layer: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width, planted if i == planted_layer else "") for i in range(3))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        if pad is None:
            pad = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool)
            pad[:, -1] = True  # the last position is padding
        for layer in self.layers:
            x = layer(x, pad)
        return self.head(x).sum()


def batch(width: int = 16) -> torch.Tensor:
    return torch.randn(2, 5, width)


def nothing_left() -> None:
    mod = torch.nn.modules.module
    assert not mod._global_forward_pre_hooks
    assert not mod._global_forward_hooks
    assert not watch_module._is_active()


# -- producer vs propagator -------------------------------------------------------------


def test_forward_producer_named_by_module_and_op():
    model = Model(planted="log")
    x = batch()
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            model(x)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, cg.GuardError)
    assert err.op == "aten.log.default"
    assert err.module == "layers.1.ff"
    assert err.phase == "forward"
    assert err.nan_count == 2 * 5 * 16 and err.posinf_count == 0 and err.neginf_count == 0
    assert err.first_bad_index == 0 and err.first_bad_coords == [0, 0, 0]
    assert err.shape == [2, 5, 16] and err.dtype == "torch.float32"
    assert err.input_names == ["self"] and err.input_shapes == [[2, 5, 16]]
    assert err.input_dtypes == ["torch.float32"]
    assert "aten.log.default in module 'layers.1.ff' (forward)" in str(err)
    assert "log of a negative number" in str(err)
    nothing_left()


def test_propagators_after_the_producer_are_never_blamed():
    # The NaN from log spreads through fc2, the residual add, layer 2 and the head;
    # async keeps only the first finding, and that is log, not any of those.
    model = Model(planted="log", planted_layer=0)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="async", allow=()):
            model(batch())
    assert info.value.op == "aten.log.default" and info.value.module == "layers.0.ff"


def test_allowed_producer_then_propagators_raise_nothing():
    model = Model(planted="log", planted_layer=0)
    with cg.watch(model, mode="sync", allow=["aten.log"]):
        out = model(batch())
    assert out.isnan()


def test_masks_with_minus_inf_raise_nothing_forward_and_backward():
    model = Model()
    x = batch().requires_grad_()
    with cg.watch(model, mode="sync"):
        loss = model(x)
        loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    nothing_left()


def test_inplace_producer_is_judged_on_its_input_before_the_op():
    model = Model(planted="log_")
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            model(batch())
    assert info.value.op == "aten.log_.default" and info.value.module == "layers.1.ff"


def test_scalar_argument_minus_inf_is_not_a_producer():
    x = torch.randn(4, 4)
    with cg.watch(None, mode="sync"):
        full = torch.full((4, 4), float("-inf"))
        y = x.masked_fill(x > 0, float("inf"))
        z = torch.clamp(y, max=float("inf"))
    assert torch.isinf(full).all() and torch.isinf(z).any()


def test_division_by_zero_inside_a_composite_names_the_inner_op():
    x = torch.randn(3, 4)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            F.normalize(x, eps=0.0) / torch.zeros(4)
    assert info.value.op == "aten.div.Tensor"
    assert "module" not in info.value.fields  # functional code: outside any module
    assert "outside the watched model's modules" in str(info.value)


# -- entry ----------------------------------------------------------------------------


def test_non_finite_argument_is_reported_at_entry_by_name():
    model = Model()
    x = batch()
    x[1, 2, 3] = float("nan")
    with pytest.raises(cg.NonFiniteEntryError) as info:
        with cg.watch(model, mode="sync"):
            model(x)
    err = info.value
    assert isinstance(err, cg.NonFiniteInputError)
    assert err.role == "argument" and err.name == "x"
    assert err.nan_count == 1 and err.first_bad_coords == [1, 2, 3]
    assert "argument 'x'" in str(err)
    nothing_left()


def test_non_finite_parameter_is_reported_at_entry_by_name():
    model = Model()
    with torch.no_grad():
        model.layers[2].ff.fc1.weight[3, 4] = float("inf")
    with pytest.raises(cg.NonFiniteEntryError) as info:
        with cg.watch(model, mode="async"):
            raise AssertionError("the block must not start")
    err = info.value
    assert err.role == "parameter" and err.name == "layers.2.ff.fc1.weight"
    assert err.posinf_count == 1 and err.first_bad_coords == [3, 4]
    nothing_left()


def test_non_finite_buffer_is_reported_and_can_be_allowed():
    model = Model()
    model.register_buffer("mask", torch.full((3,), float("-inf")))
    with pytest.raises(cg.NonFiniteEntryError) as info:
        with cg.watch(model, mode="sync"):
            pass
    assert info.value.role == "buffer" and info.value.name == "mask"
    with cg.watch(model, mode="sync", allow=["mask"]):
        model(batch())


def test_parameter_fixed_after_a_report_is_scanned_again():
    model = Model()
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    with pytest.raises(cg.NonFiniteEntryError):
        with cg.watch(model, mode="sync"):
            pass
    with torch.no_grad():
        model.head.weight[0, 0] = 0.5
    with cg.watch(model, mode="sync"):
        model(batch())


# -- backward -------------------------------------------------------------------------


def test_backward_only_inf_is_named_with_phase_backward():
    model = Model(planted="sqrt")
    x = batch()
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            loss = model(x)  # finite: sqrt(0) = 0
            assert torch.isfinite(loss)
            loss.backward()
    err = info.value
    assert err.phase == "backward"
    assert err.module == "layers.1.ff"
    assert err.backward_node == "SqrtBackward0"
    assert err.posinf_count > 0
    assert "(backward)" in str(err)
    nothing_left()


def test_backward_async_reports_at_the_end_of_the_block():
    model = Model(planted="sqrt")
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="async"):
            model(batch()).backward()
    assert info.value.phase == "backward" and info.value.deferred
    assert "recorded at that op (mode='async')" in str(info.value)


# -- allow ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "allow",
    [
        ["aten.log"],
        ["aten.log.default"],
        [torch.ops.aten.log.default],
        [torch.ops.aten.log],
        ["layers.1.ff"],
        ["layers.*"],
        ["layers.1"],
    ],
)
def test_allow_by_op_or_module_pattern(allow):
    model = Model(planted="log")
    with cg.watch(model, mode="sync", allow=allow):
        model(batch())


@pytest.mark.parametrize("allow", [["aten.exp"], ["layers.0.*"], ["head"]])
def test_allow_that_does_not_match_still_raises(allow):
    model = Model(planted="log")
    with pytest.raises(cg.NonFiniteOutputError):
        with cg.watch(model, mode="sync", allow=allow):
            model(batch())


# -- async ----------------------------------------------------------------------------


def test_async_does_not_raise_at_the_op_but_at_check():
    x = torch.rand(8) + 1.0
    with cg.watch(None, mode="async"):
        y = torch.log(-x)  # returns: async never raises at the producing op
        with pytest.raises(cg.NonFiniteOutputError) as info:
            cg.check()
        cg.check()  # reported once
    assert info.value.op == "aten.log.default" and info.value.deferred
    assert y.isnan().all()


def test_async_raises_at_the_next_watched_op_naming_the_first():
    x = torch.rand(8) + 1.0
    with cg.watch(None, mode="async"):
        y = torch.log(-x)
        with pytest.raises(cg.NonFiniteOutputError) as info:
            torch.exp(x)  # a clean op: it finds the record filled
    assert info.value.op == "aten.log.default"
    assert y.isnan().all()


def test_async_raises_at_the_end_of_the_block():
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="async"):
            torch.log(-torch.rand(8) - 1.0)
    assert info.value.op == "aten.log.default"
    nothing_left()


def test_mode_none_follows_guard_mode_rules(monkeypatch):
    monkeypatch.setenv("CUBLAS_GUARD_MODE", "off")
    with cg.watch(None):
        torch.log(-torch.rand(4) - 1.0)  # off: nothing watched
    monkeypatch.setenv("CUBLAS_GUARD_MODE", "sync")
    with pytest.raises(cg.NonFiniteOutputError):
        with cg.watch(None):
            torch.log(-torch.rand(4) - 1.0)
    with cg.guard("async", check_on_exit=False):
        with pytest.raises(cg.NonFiniteOutputError) as info:
            with cg.watch(None):
                torch.log(-torch.rand(4) - 1.0)
    assert info.value.deferred


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be"):
        cg.watch(None, mode="fast")


# -- cuBLAS / CUDA errors re-raised ----------------------------------------------------

_FAILURE = {"message": ""}


@torch.library.custom_op("watchtest::failing_gemm", mutates_args=())
def failing_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _FAILURE["message"]:
        raise RuntimeError(_FAILURE["message"])
    return a @ b


class GemmLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return failing_gemm(x, self.w)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = GemmLayer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(x))


@pytest.fixture
def failure():
    def set_message(message: str) -> None:
        _FAILURE["message"] = message

    yield set_message
    _FAILURE["message"] = ""


def test_cublas_error_from_any_op_is_reraised_typed_with_module_and_op(failure):
    message = (
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, "
        "m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc)`"
    )
    failure(message)
    model = Outer()
    with pytest.raises(cg.CublasError) as info:
        with cg.watch(model, mode="sync"):
            model(torch.randn(4, 6))
    err = info.value
    assert not isinstance(err, cg.CublasOutOfMemoryError)
    assert err.status == 13 and err.status_name == "CUBLAS_STATUS_EXECUTION_FAILED"
    assert err.op == "watchtest.failing_gemm.default" and err.module == "proj"
    assert err.input_names == ["a", "b"] and err.input_shapes == [[4, 6], [6, 3]]
    assert err.input_strides == [[6, 1], [3, 1]]
    assert isinstance(err.__cause__, RuntimeError) and str(err.__cause__) == message
    text = str(err)
    assert "watch: watchtest.failing_gemm.default in module 'proj'" in text
    assert "an EARLIER asynchronous CUDA error" in text  # the same diagnosis SafeLinear gives
    nothing_left()


def test_cublas_alloc_failed_is_reraised_as_out_of_memory(failure):
    failure("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    model = Outer()
    with pytest.raises(cg.CublasOutOfMemoryError) as info:
        with cg.watch(model, mode="async"):
            model(torch.randn(4, 6))
    assert isinstance(info.value, torch.OutOfMemoryError) and info.value.status == 3


def test_cuda_error_is_reraised_as_pending_cuda_error(failure):
    model = Outer()
    x = torch.randn(4, 6, requires_grad=True)
    failure("CUDA error: device-side assert triggered")
    with pytest.raises(cg.PendingCudaError) as info:
        with cg.watch(model, mode="sync"):
            model(x)
    assert info.value.cuda_error_string == "device-side assert triggered"
    assert info.value.module == "proj"


def test_other_errors_pass_through_unchanged(failure):
    failure("something else went wrong")
    model = Outer()
    with pytest.raises(RuntimeError, match="something else went wrong") as info:
        with cg.watch(model, mode="sync"):
            model(torch.randn(4, 6))
    assert not isinstance(info.value, cg.GuardError)
    nothing_left()


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
        ops_seen, scanned, saved = w.stats()
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
    # CPU: the foreach op loops over log_ (the producer); CUDA: one fused kernel
    assert info.value.op in ("aten.log_.default", "aten._foreach_log_.default")


def test_foreach_inplace_propagator_is_not_blamed():
    xs = [torch.tensor([1.0, float("nan")]), torch.rand(3)]
    with cg.watch(None, mode="sync"):
        torch._foreach_mul_(xs, 2.0)  # the NaN was there before the op


def test_known_values_spare_rescans_but_see_every_write():
    x = torch.rand(1000) + 0.5
    with cg.watch(None, mode="sync") as w:
        y = x * 2.0  # scanned: y known finite
        y.mul_(3.0)  # y's values before the op are known: no pre-scan
        _, scanned, saved = w.stats()
        assert saved >= 1
        y.sub_(10.0)  # finite -> finite, negative now
        with pytest.raises(cg.NonFiniteOutputError) as info:
            y.log_()  # the known "finite" of y is replaced by every write
    assert info.value.op == "aten.log_.default"
    z = torch.rand(10) + 0.5
    with cg.watch(None, mode="sync"):
        z2 = z * 1.0
        z2.data.fill_(float("nan"))  # another version counter, same storage: forgotten
        z2.mul_(2.0)  # NaN before the op: a propagator, not blamed


def test_optimizer_step_inplace_chain_spares_scans():
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(batch()).backward()
    with cg.watch(model, mode="async") as w:
        opt.step()
        ops, scanned, saved = w.stats()
    assert saved > 0 and scanned > 0
    # the step's own scans leave the parameters known finite: the next block's
    # entry check does not scan them again
    for p in model.parameters():
        entry = watch_module._clean_versions.get(id(p))
        assert entry is not None and entry[0]() is p and entry[1] == p._version


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
    # CPU's foreach ops loop over the per-tensor op; CUDA's are one fused kernel
    assert info.value.op in ("aten.addcmul_.default", "aten._foreach_addcmul_.Scalar")
    assert info.value.posinf_count > 0


# -- outputs finite by construction: not scanned (issue 13, cost) ----------------------------
#
# csrc/watch.cpp's Values lists. Each op below moves values (or writes 0/1 or a
# finite scalar): its output is not scanned. A non-finite input must still
# make it a propagator (never blamed, and its output never remembered as
# finite); narrowing casts, out-of-range scalars and arithmetic that can
# overflow are still scanned and blamed.

_NAN_ROW = 1  # the row of the planted NaN


def _planted_nan(x: torch.Tensor) -> torch.Tensor:
    """x with NaN in one row, made by an allowed producer (log of a negative) inside the block."""
    sign = torch.ones_like(x)
    sign[_NAN_ROW] = -1.0
    return torch.log(sign * x.abs() + sign * 0.5)  # log(-(|x| + 0.5)) = NaN in that row


_MASK = torch.tensor([[True, False, False, True]]).expand(4, 4).contiguous()
_IDX = torch.tensor([1, 0, 3])
_TWO = torch.tensor(2.0)  # made before the block: one element, read rather than looked up

_MOVES = {
    "clone": lambda x: x.clone(),
    "contiguous": lambda x: x.t().contiguous(),
    "copy_": lambda x: torch.zeros(4, 4).copy_(x),
    "to_float64": lambda x: x.to(torch.float64),
    "_unsafe_view": lambda x: torch.ops.aten._unsafe_view(x, [16]),
    "expand_copy": lambda x: torch.ops.aten.expand_copy(x[_NAN_ROW : _NAN_ROW + 1], [3, 4]),
    "permute_copy": lambda x: torch.ops.aten.permute_copy(x, [1, 0]),
    "repeat": lambda x: x.repeat(2, 1),
    "roll": lambda x: x.roll(1, 0),
    "flip": lambda x: x.flip(0),
    "cat": lambda x: torch.cat([x, torch.ones(1, 4)]),
    "stack": lambda x: torch.stack([x, torch.ones(4, 4)]),
    "index_select": lambda x: x.index_select(0, _IDX),
    "gather": lambda x: x.gather(0, torch.tensor([[1, 1, 1, 1]])),
    "take": lambda x: x.take(torch.tensor([4, 5])),
    "index": lambda x: x[_IDX],
    "embedding": lambda x: F.embedding(torch.tensor([1, 2]), x),
    "masked_select": lambda x: x.masked_select(_MASK),
    "masked_scatter_": lambda x: torch.zeros(4, 4).masked_scatter_(~_MASK, x),
    "slice_backward": lambda x: torch.ops.aten.slice_backward(x, [6, 4], 0, 1, 5, 1),
    "select_backward": lambda x: torch.ops.aten.select_backward(x[1], [4, 4], 0, 2),
    "tril": lambda x: x.tril(),
    "triu_": lambda x: x.clone().triu_(),
    "constant_pad_nd": lambda x: F.pad(x, (1, 1), value=2.0),
    "where": lambda x: torch.where(_MASK, x, torch.zeros(4, 4)),
    "where_scalar": lambda x: torch.where(_MASK, x, 0.0),
    "masked_fill_scalar": lambda x: x.clone().masked_fill_(_MASK, -1.0e30),
    "masked_fill_tensor": lambda x: x.clone().masked_fill_(_MASK, _TWO),
    "masked_fill_": lambda x: x.clone().masked_fill_(_MASK, 3.0),
    "relu": lambda x: torch.relu(x),
    "clamp": lambda x: x.clamp(-1.0, 1.0),
    "neg": lambda x: -x,
    "abs": lambda x: x.abs(),
    "neg_": lambda x: x.clone().neg_(),
    "abs_": lambda x: x.clone().abs_(),
    "relu_": lambda x: x.clone().relu_(),
    "clamp_": lambda x: x.clone().clamp_(-1.0, 1.0),
    "clamp_min": lambda x: x.clamp_min(0.0),
    "clamp_max_": lambda x: x.clone().clamp_max_(1.0),
    "tril_": lambda x: x.clone().tril_(),
    "where_scalar_self": lambda x: torch.where(_MASK, 0.0, x),
    "masked_fill": lambda x: x.masked_fill(_MASK, 3.0),
    "masked_scatter": lambda x: torch.zeros(4, 4).masked_scatter(~_MASK, x),
    "lift_fresh_copy": lambda x: torch.ops.aten.lift_fresh_copy(x),
    "transpose_copy": lambda x: torch.ops.aten.transpose_copy(x, 0, 1),
    "t_copy": lambda x: torch.ops.aten.t_copy(x),
    "squeeze_copy": lambda x: torch.ops.aten.squeeze_copy(x.unsqueeze(0)),
    "unsqueeze_copy": lambda x: torch.ops.aten.unsqueeze_copy(x, 0),
    "slice_copy": lambda x: torch.ops.aten.slice_copy(x, 0, 1, 3),
    "select_copy": lambda x: torch.ops.aten.select_copy(x, 0, _NAN_ROW),
    "diagonal_copy": lambda x: torch.ops.aten.diagonal_copy(x),
    "as_strided_copy": lambda x: torch.ops.aten.as_strided_copy(x, [2, 4], [4, 1], 4),
    "alias_copy": lambda x: torch.ops.aten.alias_copy(x),
    "detach_copy": lambda x: torch.ops.aten.detach_copy(x),
    "view_copy": lambda x: torch.ops.aten.view_copy(x, [16]),
    "_reshape_copy": lambda x: torch.ops.aten._reshape_copy(x, [16]),
    "narrow_copy": lambda x: torch.ops.aten.narrow_copy(x, 0, 1, 2),
    "unfold_copy": lambda x: torch.ops.aten.unfold_copy(x, 0, 2, 1),
    "diagonal_backward": lambda x: torch.ops.aten.diagonal_backward(x.diagonal(), [4, 4], 0, 0, 1),
}
# ops whose kernel writes in place again (into a copy; relu_ calls clamp_min_ on self): that op's
# pre-scan runs inside the kernel, where the table is not trusted (one scan); the output itself is
# not scanned
_MOVES_PRESCANS = {"masked_fill": 1, "masked_scatter": 1, "relu_": 1}


@pytest.mark.parametrize("name", sorted(_MOVES))
def test_moving_ops_are_not_scanned_and_never_blamed(name):
    fn = _MOVES[name]
    with cg.watch(None, mode="sync", allow=["aten.log"]) as w:
        x = torch.rand(4, 4) * 1.5 + 0.5  # scanned: known finite
        _, scanned, _ = w.stats()
        y = fn(x)
        _, scanned_after, _ = w.stats()
        assert scanned_after == scanned + _MOVES_PRESCANS.get(name, 0), f"{name}: the output was scanned"
        # known finite from its finite input: an in-place op on it needs no pre-scan
        assert watch_module._native.known_finite(y)
        bad = _planted_nan(x)
        y = fn(bad)  # a propagator: not blamed
        assert not torch.isfinite(y).all()
        assert not watch_module._native.known_finite(y)
        y.mul_(3.0)  # NaN before the op: a propagator too (pre-scanned, not taken as known)
        z = fn(bad) * 1.0
    assert z.shape == fn(x).shape


def test_moving_op_output_with_a_non_finite_input_is_not_taken_for_finite():
    # were clone's output remembered finite, mul_ would skip its pre-scan and be blamed
    outside = torch.tensor([1.0, float("nan"), 2.0])  # made before the block: unknown to it
    with cg.watch(None, mode="sync") as w:
        y = outside.clone()
        y.mul_(3.0)
        _, scanned, _ = w.stats()
    assert scanned == 2  # mul_'s pre-scan of y (NaN: a propagator) and its output


_TO_COPY = ("aten._to_copy.default", "aten.copy_.default")  # .to() copies in _to_copy's kernel


@pytest.mark.parametrize(
    "name,fn,ops",
    [
        ("fp32 -> fp16", lambda: torch.full((3,), 1e5).to(torch.float16), _TO_COPY),
        ("fp64 -> fp32", lambda: torch.full((3,), 1e300, dtype=torch.float64).float(), _TO_COPY),
        ("int32 -> fp16", lambda: torch.arange(65000, 70000, dtype=torch.int32).half(), _TO_COPY),
        ("one element fp32 -> fp16", lambda: torch.full((1,), 1e5).half(), _TO_COPY),
        (
            "copy_ fp32 -> bf16",
            lambda: torch.zeros(3, dtype=torch.bfloat16).copy_(torch.full((3,), 3.4e38)),
            ("aten.copy_.default",),
        ),
        (
            "cat fp32 into fp16 out=",
            lambda: torch.cat([torch.full((2,), 1e5)], out=torch.zeros(2, dtype=torch.float16)),
            ("aten.cat.out", "aten.copy_.default"),
        ),
        (
            "where fp16 from fp32",
            lambda: torch.where(
                torch.tensor([True, False]), torch.full((2,), 1e5), torch.zeros(2, dtype=torch.float16)
            ).half(),
            _TO_COPY,
        ),
    ],
)
def test_narrowing_moves_are_scanned_and_blamed(name, fn, ops):
    # (torch itself refuses a Scalar out of a dtype's range: fill_(1e5) on float16 raises)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            fn()
    assert info.value.op in ops and info.value.posinf_count + info.value.neginf_count > 0


_FILLS = {
    "bernoulli_": lambda x: torch.empty(100).bernoulli_(0.3),
    "bernoulli": lambda x: torch.bernoulli(torch.full((100,), 0.5)),
    "zeros": lambda x: torch.zeros(100),
    "ones": lambda x: torch.ones(100),
    "full": lambda x: torch.full((100,), 7.0),
    "fill_": lambda x: x.clone().fill_(2.0),
    "fill_tensor": lambda x: x.clone().fill_(_TWO),
    "zero_": lambda x: x.clone().zero_(),
    "zeros_like": lambda x: torch.zeros_like(x),
    "ones_like": lambda x: torch.ones_like(x),
    "full_like": lambda x: torch.full_like(x, -3.0),
    "new_zeros": lambda x: x.new_zeros(100),
    "new_ones": lambda x: x.new_ones(100),
    "new_full": lambda x: x.new_full((100,), 5.0),
    "scalar_tensor": lambda x: torch.scalar_tensor(2.5),
}


@pytest.mark.parametrize("name", sorted(_FILLS))
def test_bernoulli_and_fills_are_not_scanned(name):
    with cg.watch(None, mode="sync") as w:
        x = torch.rand(100) * 2.0
        _, scanned, _ = w.stats()
        y = _FILLS[name](x)
        _, scanned_after, _ = w.stats()
        assert scanned_after == scanned
        assert watch_module._native.known_finite(y)  # known finite: in-place ops on it skip the pre-scan
    assert y.isfinite().all()


def test_scaling_by_at_most_one_is_not_scanned_and_scaling_up_is():
    with cg.watch(None, mode="sync") as w:
        x = torch.rand(100) * 3.0e38 + 1.0  # scanned: known finite
        _, scanned, _ = w.stats()
        y = x * 0.5
        y = 0.25 * y
        y = y / 3.0
        y.mul_(0.999)
        y.div_(-2.0)
        y = y + 1e-8
        y.sub_(1.0, alpha=2.0)
        _, scanned_after, _ = w.stats()
        assert scanned_after == scanned
        assert watch_module._native.known_finite(y)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.full((4,), 3.0e38) * 2.0
    assert info.value.op == "aten.mul.Tensor" and info.value.posinf_count == 4
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.full((4,), 3.0e38).div_(0.5)
    assert info.value.op == "aten.div_.Tensor"
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.full((4,), 1.0).div(0.0)
    assert info.value.op == "aten.div.Tensor"
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.full((4,), 3.0e38) + 1e38
    assert info.value.op == "aten.add.Tensor"
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            torch.full((4,), 65504.0, dtype=torch.float16) + 16.0  # 65520 rounds to inf
    assert info.value.op == "aten.add.Tensor" and info.value.dtype == "torch.float16"
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="async"):
            x = torch.ones(4) * 1.5
            torch.add(x, 1e40, alpha=1e-30)  # alpha * other = 1e10, but 1e40 is inf as a float
    assert info.value.op in ("aten.copy_.default", "aten.add.Tensor") and info.value.posinf_count > 0


def test_scaling_an_unknown_input_is_scanned():
    outside = torch.tensor([1.0, float("nan")])
    with cg.watch(None, mode="sync") as w:
        outside * 0.5  # the input is not known finite: scanned (a propagator)
        _, scanned, _ = w.stats()
    assert scanned == 2  # the output, then the input to judge it


def test_composite_ops_reuse_their_inner_scans_at_any_depth():
    x, weight, bias = torch.randn(3, 8), torch.randn(4, 8), torch.randn(4)
    with cg.watch(None, mode="sync") as w:
        F.linear(x, weight, bias)  # composite (aten's Autograd kernel only redispatches): addmm's scan
        _, scanned, saved = w.stats()
    assert scanned == 1 and saved >= 1
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(None, mode="sync"):
            F.linear(torch.full((2, 8), 1e30), torch.full((4, 8), 1e30))
    assert info.value.op == "aten.mm.default"


def test_known_table_grows_and_drops_freed_storages():
    with cg.watch(None, mode="sync"):
        keep = [torch.rand(3) * 1.5 for _ in range(6000)]  # more than the initial 4096 slots
        assert all(watch_module._native.known_finite(t) for t in keep)
        for i in range(0, 6000, 2):
            keep[i] = None  # freed: dropped at the next prune
        more = [torch.rand(3) * 1.5 for _ in range(6000)]
        assert all(watch_module._native.known_finite(t) for t in keep if t is not None)
        assert all(watch_module._native.known_finite(t) for t in more)
        for t in more[:100]:
            t.data.fill_(float("nan"))  # another version counter: the entry is forgotten
        assert not any(watch_module._native.known_finite(t) for t in more[:100])
        # erasing shifts the entries after them back: every other one is still found
        assert all(watch_module._native.known_finite(t) for t in more[100:])
        assert all(watch_module._native.known_finite(t) for t in keep if t is not None)
        for t in more[:100]:
            t.mul_(3.0)  # NaN before the op: a propagator, not blamed


def test_known_values_carry_to_the_next_block_until_written():
    x = torch.rand(100) + 0.5
    with cg.watch(None, mode="sync", allow=["aten.log"]):
        y = x * 3.0  # scanned: finite
        z = torch.log(x - 10.0)  # scanned: NaN (allowed here)
    with cg.watch(None, mode="sync") as w:
        y.mul_(3.0)  # known from the last block: no pre-scan, only the output
        _, scanned, _ = w.stats()
    assert scanned == 1
    y.add_(1.0)  # a write outside any block bumps the version
    with cg.watch(None, mode="sync") as w:
        y.mul_(3.0)  # pre-scan and output
        _, scanned, _ = w.stats()
    assert scanned == 2
    with cg.watch(None, mode="sync") as w:
        z.mul_(3.0)  # non-finite findings are not carried: pre-scanned, a propagator
        _, scanned, _ = w.stats()
    assert scanned == 2


# -- Per device: the same promises on the CPU and, with a GPU, on CUDA (benchmarks/gpu/gpu_check.sh's
# "rest" slot runs the [cuda] cases with -k cuda). On CUDA the watch still reads each scan's
# counts with a host sync (docs/watch.md); these pin what it reports there.


class MaskedAttentionOnDevice(nn.Module):
    """Attention scores with an additive causal -inf mask made on the input's device."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        causal = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        scores = self.proj(x) @ x.transpose(-1, -2) + causal
        pad = torch.zeros(x.shape[0], t, dtype=torch.bool, device=x.device)
        pad[:, -1] = True
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        return (F.softmax(scores, dim=-1) @ x).sum()


def _feedforward_on(device: str, planted: str) -> nn.Module:
    return nn.Sequential(FeedForward(16, planted)).to(device)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_per_device_forward_producer_named_by_module_and_op(device, mode):
    model = _feedforward_on(device, "log")
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode=mode):
            model(torch.randn(2, 5, 16, device=device))
    err = info.value
    assert err.op == "aten.log.default" and err.module == "0" and err.phase == "forward"
    assert err.nan_count == 2 * 5 * 16 and err.first_bad_index == 0
    assert err.shape == [2, 5, 16]
    assert f"on {device}" in str(err)
    nothing_left()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_per_device_backward_only_inf_is_named_with_phase_backward(device, mode):
    model = _feedforward_on(device, "sqrt")
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode=mode):
            loss = model(torch.randn(2, 5, 16, device=device)).sum()
            assert torch.isfinite(loss)
            loss.backward()  # the engine runs CUDA backward ops on its device thread
    err = info.value
    assert err.phase == "backward" and err.module == "0"
    assert err.backward_node == "SqrtBackward0"
    assert err.posinf_count + err.neginf_count > 0
    nothing_left()


def test_per_device_minus_inf_masks_raise_nothing_forward_and_backward(device):
    model = MaskedAttentionOnDevice().to(device)
    x = torch.randn(2, 5, 16, device=device, requires_grad=True)
    with cg.watch(model, mode="sync"):
        loss = model(x)
        loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    nothing_left()


def test_per_device_non_finite_argument_is_reported_at_entry_with_safelinear(device):
    model = cg.replace_linear(_feedforward_on(device, ""))
    assert isinstance(model[0].fc1, cg.SafeLinear)
    x = torch.randn(2, 5, 16, device=device)
    x[1, 2, 3] = float("inf")
    with pytest.raises(cg.NonFiniteEntryError) as info:
        with cg.watch(model, mode="sync"):
            model(x)
    assert info.value.role == "argument" and info.value.posinf_count == 1
    assert info.value.first_bad_coords == [1, 2, 3]
    with cg.watch(model, mode="async"):  # clean: nothing reported, results unchanged
        out = model(torch.ones(2, 5, 16, device=device))
    assert torch.isfinite(out).all()
    nothing_left()
