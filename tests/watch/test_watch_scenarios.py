"""watch's scenarios, one protocol: each runs a small model under watch and must raise the class
it names (None: silent), with the op or the argument named. The other watch test files check
each scenario's fields and message in detail; here they run side by side, so a change to the
protocol shows in one place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers import watch_models as wm


def outcome(scenario: Callable[[], Any]) -> cg.GuardError | None:
    """What a scenario raised; None when silent."""
    try:
        scenario()
    except cg.GuardError as e:
        return e
    return None


# -- scenarios: each builds its inputs from a fixed seed and returns nothing ----------------


def clamped_log(mode: str) -> Callable[[], None]:
    def run() -> None:
        torch.manual_seed(0)
        model = wm.Net(clamp=True)
        with cg.watch(model, mode=mode):
            model(torch.randn(16, 8)).square().mean().backward()

    return run


def log_reaching_output(mode: str) -> Callable[[], None]:
    def run() -> None:
        torch.manual_seed(0)
        model = wm.Net(clamp=False)
        with cg.watch(model, mode=mode):
            model(torch.randn(16, 8))

    return run


def log_reaching_loss() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    with cg.watch(model, mode="sync"):
        torch.log(model(torch.randn(16, 8))).mean().backward()


def clamped_log_outside() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    with cg.watch(model, mode="sync"):
        torch.log(model(torch.randn(16, 8))).clamp_min(-5.0).mean().backward()


def birth_report(mode: str) -> Callable[[], None]:
    def run() -> None:
        torch.manual_seed(0)
        model = wm.Net(clamp=True)
        with cg.watch(model, mode=mode, report="birth"):
            model(torch.randn(16, 8))

    return run


def argument_inf_reaching_output() -> None:
    torch.manual_seed(0)
    model = wm.Identityish()
    bias = torch.zeros(4)
    bias[2] = float("inf")
    with cg.watch(model, mode="sync"):
        model(torch.randn(3, 4), bias)


def argument_mask_softmax() -> None:
    class Masked(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x + mask, dim=-1)

    torch.manual_seed(0)
    mask = torch.zeros(4, 4)
    mask[:, 0] = float("-inf")
    with cg.watch(Masked(), mode="sync"):
        Masked()(torch.randn(4, 4), mask)


def nan_in_parameter_gradient(mode: str) -> Callable[[], None]:
    class SqrtZero(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(torch.relu(self.fc(x)) * 0.0).sum()

    def run() -> None:
        torch.manual_seed(0)
        model = SqrtZero()
        with cg.watch(model, mode=mode):
            model(torch.randn(3, 4)).backward()

    return run


def inf_into_optimizer_state() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    with torch.no_grad():
        model.weight.grad.fill_(1e30)
    with cg.watch(model, mode="sync"):
        opt.step()


def inf_into_buffer() -> None:
    class Running(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.total.add_(torch.exp(x).sum(0))
            return x.sum()

    model = Running()
    with cg.watch(model, mode="sync"):
        model(torch.full((2, 4), 100.0))


def mha_causal_mask() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 6, 16, requires_grad=True)
    causal = torch.full((6, 6), float("-inf")).triu(1)
    with cg.watch(mha, mode="sync"):
        out, weights = mha(x, x, x, attn_mask=causal)
        (out.sum() + weights.sum()).backward()


def encoder_layer_mask(mode: str) -> Callable[[], None]:
    def run() -> None:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True, dropout=0.0)
        src = torch.randn(2, 7, 16)
        mask = nn.Transformer.generate_square_subsequent_mask(7)
        with cg.watch(layer, mode=mode):
            layer(src, src_mask=mask).sum().backward()

    return run


def t5(report: str) -> Callable[[], None]:
    def run() -> None:
        model = wm.tiny_t5()
        ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(0))
        with cg.watch(model, mode="sync", report=report):
            model(input_ids=ids, labels=ids).loss.backward()

    return run


def planted(kind: str, mode: str, report: str = "consequence") -> Callable[[], None]:
    """test_watch's model with a NaN/Inf planted in layers.1.ff (forward, in place, backward)."""

    def run() -> None:
        torch.manual_seed(0)
        model = wm.Model(planted=kind)
        with cg.watch(model, mode=mode, report=report):
            model(wm.batch()).backward()

    return run


def scalar_minus_inf_and_composite() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 4)
    with cg.watch(None, mode="sync"):
        y = x.masked_fill(x > 0, float("-inf")).softmax(-1)  # a Scalar -inf: not a producer
        F.normalize(torch.zeros(2, 3) / torch.zeros(2, 3), dim=-1)  # 0/0 inside: div is the producer
    del y


def two_origins_meet() -> None:
    """Two births meet in one op: the output inherits the earlier origin (log, not exp)."""

    class TwoBirths(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = torch.log(torch.relu(x))  # -inf where x <= 0: born first
            b = torch.exp(x * 1000.0)  # +inf where x > 0.09: born second
            return a + b

    torch.manual_seed(0)
    model = TwoBirths()
    with cg.watch(model, mode="sync"):
        model(torch.randn(4, 4))


def async_check() -> None:
    torch.manual_seed(0)
    with cg.watch(None, mode="async"):
        torch.log(torch.tensor([-1.0, 2.0]))
        torch.exp(torch.tensor([1000.0]))  # a second producer: the first is what is kept
        cg.check()


def allowed(allow: list[str]) -> Callable[[], None]:
    def run() -> None:
        torch.manual_seed(0)
        model = wm.Model(planted="log")
        with cg.watch(model, mode="sync", allow=allow, report="birth"):
            model(wm.batch())

    return run


def optimizer_steps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for _ in range(2):
        with cg.watch(model, mode="async"):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()


SCENARIOS: dict[str, tuple[Callable[[], None], str | None]] = {
    # name: (scenario, the class it must raise; None: silent)
    "clamped_log_sync": (clamped_log("sync"), None),
    "clamped_log_async": (clamped_log("async"), None),
    "log_reaching_output_sync": (log_reaching_output("sync"), "NonFiniteOutputError"),
    "log_reaching_output_async": (log_reaching_output("async"), "NonFiniteOutputError"),
    "log_reaching_loss": (log_reaching_loss, "NonFiniteOutputError"),
    "clamped_log_outside": (clamped_log_outside, None),
    "birth_sync": (birth_report("sync"), "NonFiniteOutputError"),
    "birth_async": (birth_report("async"), "NonFiniteOutputError"),
    "argument_inf_reaching_output": (argument_inf_reaching_output, "NonFiniteEntryError"),
    "argument_mask_softmax": (argument_mask_softmax, None),
    "nan_in_parameter_gradient_sync": (nan_in_parameter_gradient("sync"), "NonFiniteOutputError"),
    "nan_in_parameter_gradient_async": (nan_in_parameter_gradient("async"), "NonFiniteOutputError"),
    "inf_into_optimizer_state": (inf_into_optimizer_state, "NonFiniteOutputError"),
    "inf_into_buffer": (inf_into_buffer, "NonFiniteOutputError"),
    "mha_causal_mask": (mha_causal_mask, None),
    "encoder_layer_mask_sync": (encoder_layer_mask("sync"), None),
    "encoder_layer_mask_async": (encoder_layer_mask("async"), None),
    "t5_clean": (t5("consequence"), None),
    "t5_birth": (t5("birth"), "NonFiniteOutputError"),
    "planted_log_sync": (planted("log", "sync"), "NonFiniteOutputError"),
    "planted_log_async": (planted("log", "async"), "NonFiniteOutputError"),
    "planted_inplace_log_sync": (planted("log_", "sync"), "NonFiniteOutputError"),
    "planted_inplace_log_birth": (planted("log_", "sync", "birth"), "NonFiniteOutputError"),
    "planted_backward_sqrt_sync": (planted("sqrt", "sync"), "NonFiniteOutputError"),
    "planted_backward_sqrt_async_birth": (planted("sqrt", "async", "birth"), "NonFiniteOutputError"),
    "scalar_minus_inf_and_composite": (scalar_minus_inf_and_composite, "NonFiniteOutputError"),
    "async_check": (async_check, "NonFiniteOutputError"),
    "two_origins_meet": (two_origins_meet, "NonFiniteOutputError"),
    "allowed_op": (allowed(["aten.log"]), None),
    "allowed_module": (allowed(["layers.1.*"]), None),
    "allow_not_matching": (allowed(["aten.exp"]), "NonFiniteOutputError"),
    "optimizer_steps": (optimizer_steps, None),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_scenario_raises_its_class_naming_the_op_or_argument(name):
    scenario, expected = SCENARIOS[name]
    err = outcome(scenario)
    assert (type(err).__name__ if err is not None else None) == expected, str(err)
    if err is not None:
        assert err.fields["op"] is not None or err.fields["name"] is not None
        assert err.fields["nan_count"] + err.fields["posinf_count"] + err.fields["neginf_count"] > 0
    wm.nothing_left()
