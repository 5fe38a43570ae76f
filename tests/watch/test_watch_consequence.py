"""watch judges a non-finite value by its consequences, not by its birth.

A NaN/Inf carries its origin (op, module, phase, the Python stack at its birth) and becomes a
finding only when it reaches a result that matters: the watched model's outputs, a loss, a
parameter's or input's gradient, a parameter or buffer written in the block, state written
outside the model (an optimizer's). ``report="birth"`` keeps the raise-at-birth rule."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn

import cublas_guard_ext as cg

from helpers import requires_cuda
from helpers.watch_models import Identityish, Net, nothing_left, tiny_t5

watch_module = importlib.import_module("cublas_guard_ext.watching.session")
patches_module = importlib.import_module("cublas_guard_ext.watching.global_patches")


def test_clamped_log_of_zero_is_silent_forward_and_backward():
    model = Net(clamp=True)
    x = torch.randn(16, 8)
    with cg.watch(model, mode="sync"):
        loss = model(x).square().mean()
        loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    nothing_left()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_log_of_zero_reaching_the_output_is_named_at_its_birth(mode):
    model = Net(clamp=False)
    x = torch.randn(16, 8)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode=mode):
            model(x)
    err = info.value
    assert err.op == "aten.log.default" and err.module == "head" and err.phase == "forward"
    assert err.neginf_count > 0 and err.nan_count == 0
    assert err.reached == "the model's output"
    assert "reached: the model's output" in str(err)
    # the Python stack at the birth: this file's LogHead.forward, the line with torch.log
    assert "test_watch_consequence.py" in err.birth_stack and "in forward" in err.birth_stack
    assert "born at" in str(err)
    nothing_left()


def test_log_of_zero_reaching_a_loss_outside_the_model_is_named_at_its_birth():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(16, 8)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            h = model(x)  # finite: the model's output is clean
            loss = torch.log(h).mean()  # log(0) = -inf, outside the model: reaches the loss
            loss.backward()
    err = info.value
    assert err.op == "aten.log.default" and err.module is None and "outside any module" in err.outside
    assert err.reached == "the loss (a root of backward)"
    nothing_left()


def test_a_finite_loss_with_a_clamped_log_outside_the_model_is_silent():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(16, 8)
    with cg.watch(model, mode="sync"):
        loss = torch.log(model(x)).clamp_min(-5.0).mean()
        loss.backward()
    assert torch.isfinite(loss)


def test_report_birth_keeps_raising_at_the_op():
    model = Net(clamp=True)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync", report="birth"):
            model(torch.randn(16, 8))
    assert info.value.op == "aten.log.default" and info.value.module == "head"
    assert info.value.reached is None
    nothing_left()


def test_report_is_checked():
    with pytest.raises(ValueError, match="report must be"):
        cg.watch(nn.Linear(2, 2), report="later")
    with pytest.raises(ValueError, match="needs the model"):
        cg.watch(None, report="consequence")


def test_argument_inf_reaching_the_output_is_an_entry_finding():
    model = Identityish()
    bias = torch.zeros(4)
    bias[2] = float("inf")
    with pytest.raises(cg.NonFiniteEntryError) as info:
        with cg.watch(model, mode="sync"):
            model(torch.randn(3, 4), bias)
    err = info.value
    assert err.role == "argument" and err.name == "bias"
    assert err.posinf_count == 1 and err.first_bad_coords == [2]
    assert err.reached == "the model's output"
    nothing_left()


def test_argument_inf_that_the_model_masks_is_silent():
    class Masked(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x + mask, dim=-1)

    mask = torch.zeros(4, 4)
    mask[:, 0] = float("-inf")
    model = Masked()
    with cg.watch(model, mode="sync"):
        out = model(torch.randn(4, 4), mask)
    assert torch.isfinite(out).all()


def test_nan_in_a_parameter_gradient_is_a_finding_though_the_loss_is_finite():
    class SqrtZero(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(torch.relu(self.fc(x)) * 0.0).sum()  # 0 forward, Inf gradient

    model = SqrtZero()
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            loss = model(torch.randn(3, 4))
            assert torch.isfinite(loss)
            loss.backward()
    err = info.value
    assert err.phase == "backward" and err.backward_node == "SqrtBackward0"
    # born in backward from finite values (sqrt's gradient at 0): a gradient computed wrong
    assert "gradient" in err.reached
    nothing_left()


def test_inf_written_into_optimizer_state_is_a_finding():
    model = nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    with torch.no_grad():
        model.weight.grad.fill_(1e30)  # grad * grad overflows in Adam's second moment
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            opt.step()
    # the optimizer's state, named (issue 47; tests/watch/test_watch_optimizer.py has the rest)
    assert info.value.reached == "Adam's state exp_avg_sq of parameter 'weight'"
    assert info.value.phase == "optimizer step"


def test_inf_written_into_a_buffer_is_a_finding():
    class Running(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.total.add_(torch.exp(x).sum(0))  # exp(100) = inf in float32
            return x.sum()

    model = Running()
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync"):
            model(torch.full((2, 4), 100.0))
    assert info.value.op == "aten.exp.default"
    assert info.value.reached.startswith("the model's parameter or buffer 'total'")


# -- the acceptance models: masks as arguments, T5 ----------------------------------------


def test_multihead_attention_with_a_causal_minus_inf_mask_is_silent():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 6, 16, requires_grad=True)
    causal = torch.full((6, 6), float("-inf")).triu(1)
    with cg.watch(mha, mode="sync"):
        out, weights = mha(x, x, x, attn_mask=causal)
        (out.sum() + weights.sum()).backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    nothing_left()


def test_transformer_encoder_layer_with_the_square_subsequent_mask_is_silent():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True, dropout=0.0)
    src = torch.randn(2, 7, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(7)
    assert torch.isinf(mask).any()
    with cg.watch(layer, mode="sync"):
        out = layer(src, src_mask=mask)
        out.sum().backward()
    assert torch.isfinite(out).all()
    layer.eval()
    with torch.no_grad(), cg.watch(layer, mode="sync"):
        layer(src, src_mask=mask)
    nothing_left()


def test_t5_forward_and_backward_run_clean():
    model = tiny_t5()
    ids = torch.randint(1, 64, (2, 9))
    labels = torch.randint(1, 64, (2, 5))
    with cg.watch(model, mode="sync"):
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
    assert torch.isfinite(out.loss)
    with cg.watch(model, mode="async"):
        model(input_ids=ids, labels=labels).loss.backward()
    nothing_left()


def test_t5_log_of_zero_is_what_birth_mode_reports():
    # the -inf of T5's relative-position buckets (log(0), cast to an index): report="birth" keeps it
    model = tiny_t5()
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(model, mode="sync", report="birth"):
            model(input_ids=torch.randint(1, 64, (2, 9)), labels=torch.randint(1, 64, (2, 5)))
    assert info.value.op == "aten.log.default" and info.value.neginf_count > 0
    assert "SelfAttention" in info.value.module


# -- per device: the same rule on the CPU and, with a GPU, on CUDA (the GPU script runs -k cuda) --


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_per_device_clamped_log_is_silent_and_unclamped_is_named(device, mode):
    torch.manual_seed(0)
    x = torch.randn(16, 8, device=device)
    clamped = Net(clamp=True).to(device)
    with cg.watch(clamped, mode=mode):
        clamped(x).square().mean().backward()
    unclamped = Net(clamp=False).to(device)
    with pytest.raises(cg.NonFiniteOutputError) as info:
        with cg.watch(unclamped, mode=mode):
            unclamped(x)
    assert info.value.op == "aten.log.default" and info.value.module == "head"
    assert info.value.reached == "the model's output"
    nothing_left()


def test_per_device_attention_masks_as_arguments_are_silent(device):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).to(device)
    x = torch.randn(2, 6, 16, device=device, requires_grad=True)
    causal = torch.full((6, 6), float("-inf"), device=device).triu(1)
    with cg.watch(mha, mode="sync"):
        out, _ = mha(x, x, x, attn_mask=causal)
        out.sum().backward()
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True, dropout=0.0).to(device)
    mask = nn.Transformer.generate_square_subsequent_mask(6, device=device)
    with cg.watch(layer, mode="async"):
        layer(x.detach(), src_mask=mask).sum().backward()
    nothing_left()


@requires_cuda
def test_a_watched_cuda_step_makes_no_host_sync():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)).cuda()
    x = torch.randn(32, 64, device="cuda")
    model(x).sum().backward()  # warm up outside the check
    block = cg.watch(model, mode="async")
    block.__enter__()
    try:
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    finally:
        block.__exit__(None, None, None)  # the final check may read the record


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_fused_entry_check_finds_every_kind_of_bad_value(dtype):
    """watch's one-read entry check of a device's parameters: exact for NaN, +Inf and -Inf
    anywhere, in contiguous, strided and grad-requiring tensors, and no overflow on the
    largest finite values."""
    from cublas_guard_ext.watching.session import _native

    big = torch.finfo(dtype).max
    tensors = [
        torch.full((3, 5), big, dtype=dtype),
        torch.full((7,), -big, dtype=dtype),
        torch.zeros(4, 6, dtype=dtype)[:, ::2],
        torch.zeros(2, 2, dtype=dtype, requires_grad=True),
    ]
    assert _native._watch_all_finite(tensors)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for which in range(len(tensors)):
            poisoned = [t.detach().clone() for t in tensors]
            base = torch.zeros(4, 6, dtype=dtype)
            poisoned[2] = base[:, ::2]
            if which == 2:
                base[-1, 4] = bad  # an element the strided view holds
            else:
                poisoned[which].view(-1)[-1] = bad
            assert not _native._watch_all_finite(poisoned), (bad, which)
    hidden = torch.zeros(4, 6, dtype=dtype)
    hidden[0, 1] = float("nan")  # outside the strided view: not its value
    assert _native._watch_all_finite([hidden[:, ::2]])


def test_the_entry_check_reads_dtypes_the_fused_scan_does_not():
    from cublas_guard_ext.watching.session import _native

    fp8 = getattr(torch, "float8_e5m2", None)
    if fp8 is None:
        pytest.skip("this torch has no float8_e5m2")
    t = torch.zeros(5, dtype=fp8)
    assert _native._watch_all_finite([t]) and _native._watch_all_finite([])
    t[3] = float("inf")
    assert not _native._watch_all_finite([t])
    with pytest.raises(TypeError, match="expected a sequence of tensors"):
        _native._watch_all_finite([t, 3])


@requires_cuda
def test_a_cuda_block_start_reads_the_host_once_for_all_parameters():
    """The entry check of a CUDA model's parameters: one fused check, one host read (was one per
    parameter); a NaN parameter is still named."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)]).cuda()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            block = cg.watch(model, mode="async")
            block.__enter__()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    block.__exit__(None, None, None)
    syncs = [w for w in seen if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]
    with torch.no_grad():
        model[4].bias[3] = float("nan")
    with pytest.raises(cg.NonFiniteEntryError) as info:
        with cg.watch(model, mode="sync"):
            pass
    assert info.value.role == "parameter" and info.value.name == "4.bias" and info.value.nan_count == 1
