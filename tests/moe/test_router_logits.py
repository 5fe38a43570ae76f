"""A guarded router's logits growing toward the softmax's saturation (issue 47, point 6): one
RouterLogitsWarning per router, before anything overflows, naming the router, the dtype, the
absmax logit, the threshold, the one-hot fraction and the next step; none on a clean model; the
outputs unchanged; strict raises."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import pytest
import torch

import cublas_guard_ext as cg
from cublas_guard_ext.models import routers

from helpers.moe_models import mixtral, qwen3_moe

ROUTER = "model.layers.0.mlp.gate"
DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(autouse=True)
def default_limits():
    saved = (routers.LIMITS.threshold, routers.LIMITS.strict)
    routers.LIMITS.threshold, routers.LIMITS.strict = None, False
    yield
    routers.LIMITS.threshold, routers.LIMITS.strict = saved


def _scaled(model: torch.nn.Module, factor: float = 60.0) -> torch.nn.Module:
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.mul_(factor)
    return model


def _router_warnings(record: list) -> list:
    return [w for w in record if issubclass(w.category, cg.RouterLogitsWarning)]


def _run(model: torch.nn.Module, calls: int = 1) -> tuple[torch.Tensor, list]:
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 9))
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(calls):
            out = model(ids).logits
    return out, _router_warnings(record)


def test_large_router_logits_warn_once_naming_the_router_with_the_numbers():
    torch.manual_seed(0)
    plain = _scaled(mixtral())
    guarded = cg.replace_linear(copy.deepcopy(plain))
    out, found = _run(guarded, calls=5)  # a flood: five calls, one warning
    assert len(found) == 1
    text = str(found[0].message)
    with torch.no_grad():
        hidden = []
        hook = plain.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, o: hidden.append(o[0]))
        torch.manual_seed(1)
        plain_out = plain(torch.randint(0, 64, (2, 9))).logits
        hook.remove()
    assert torch.equal(out, plain_out)  # the check reads the logits, changes nothing
    logits = hidden[0].float()
    absmax = float(logits.abs().max())
    one_hot = float((torch.softmax(logits, -1).amax(-1) > 0.99).float().mean())
    assert absmax > 32.0  # the float32 threshold
    headline = (
        f"cublas_guard_ext: router '{ROUTER}': its logits reached an absmax of {absmax:.4g} (torch.float32), above "
        "the threshold 32 for torch.float32 (exp overflows torch.float32 past 88.72)"
    )
    assert text.startswith(headline), text
    assert f"{one_hot:.1%} of its 18 tokens route with a top-1 probability above 0.99" in text
    assert one_hot > 0.5
    assert "at the router's call 1; warned once per router" in text
    assert (
        "router z-loss (ST-MoE): z_loss = 1e-3 * mean over tokens of logsumexp(router_logits, dim=-1) ** 2"
        in text
    )
    assert "lower the learning rate or clip gradients" in text
    assert "compute the router in float32" not in text  # it is float32 already: never advise what is on
    assert "model.layers.1" not in text


def test_a_clean_model_never_warns_and_stays_bitwise_equal():
    for build in (mixtral, qwen3_moe):
        torch.manual_seed(0)
        plain = build()
        guarded = cg.replace_linear(copy.deepcopy(plain))
        out, found = _run(guarded, calls=3)
        assert found == []
        plain_out, _ = _run(plain)
        assert torch.equal(out, plain_out)


def test_each_router_warns_once_of_its_own():
    torch.manual_seed(0)
    model = mixtral()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(60.0)
    _, found = _run(cg.replace_linear(model), calls=4)
    names = [re.search(r"router '([^']+)'", str(w.message)).group(1) for w in found]
    assert names == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]


def test_bfloat16_logits_name_their_dtype_and_advise_float32():
    torch.manual_seed(0)
    model = cg.replace_linear(_scaled(mixtral()).to(torch.bfloat16))
    _, found = _run(model)
    assert len(found) == 1
    text = str(found[0].message)
    assert "(torch.bfloat16), above the threshold 32 for torch.bfloat16" in text
    assert "compute the router in float32 (its product and the softmax), not torch.bfloat16" in text
    shown = f"RouterLogitsWarning: {text}"
    # the docs show this message word for word
    for doc, title in (("moe.md", "### Router logits\n"), ("nan-stories.md", "## MoE routers\n")):
        section = (DOCS / doc).read_text().split(title, 1)[1]
        blocks = re.findall(r"```\n(.*?)\n```", section, re.S)
        assert shown in blocks, (doc, shown)


def test_the_threshold_is_the_users_and_strict_raises():
    torch.manual_seed(0)
    model = cg.replace_linear(mixtral())
    _, found = _run(model)
    assert found == []
    routers.set_router_limits(threshold=1e-3, strict=True)
    with pytest.raises(cg.RouterLogitsError) as info:
        _run(model)
    assert info.value.router == ROUTER and info.value.threshold == 1e-3
    assert str(info.value).startswith(f"cublas_guard_ext: router '{ROUTER}': its logits reached")
    with pytest.raises(ValueError, match=r"a router threshold is a positive number, got -1"):
        routers.set_router_limits(threshold=-1)


def test_mode_off_checks_nothing():
    torch.manual_seed(0)
    model = _scaled(mixtral())
    cg.replace_linear(model, mode="off")
    _, found = _run(model)
    assert found == []
    cg.restore_linear(model)
    assert not any(routers.LOGITS_ATTR in m.__dict__ for m in model.modules())


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the async read needs CUDA (never ran on a GPU yet)"
)
def test_async_mode_on_cuda_warns_at_a_later_call_without_a_host_sync():
    torch.manual_seed(0)
    model = cg.replace_linear(_scaled(mixtral()).cuda(), mode="async")
    ids = torch.randint(0, 64, (2, 9), device="cuda")
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        model(ids)  # the stats are copied without blocking, read at a later call
        torch.cuda.synchronize()
        model(ids)
        model(ids)
    found = _router_warnings(record)
    assert len(found) == 1 and "at the router's call 1; warned once per router" in str(found[0].message)


def test_a_compiled_router_checks_its_logits_in_the_graph():
    """torch.compile (fullgraph): the check is an op of the graph, run on the compiled logits:
    the same warning once, the same output, strict raises typed; restored, it checks nothing."""
    torch.manual_seed(0)
    model = cg.replace_linear(_scaled(mixtral()))
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(18, gate.weight.shape[1])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        eager = gate(x)
    gate.__dict__.pop(routers.LOGITS_ATTR)  # the eager call's check forgotten: it warned once
    compiled = torch.compile(gate, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        outs = [compiled(x) for _ in range(3)]
    found = _router_warnings(record)
    assert len(found) == 1, [str(w.message) for w in record]
    absmax = float(eager[0].abs().max()) if isinstance(eager, tuple) else float(eager.abs().max())
    assert str(found[0].message).startswith(
        f"cublas_guard_ext: router '{ROUTER}': its logits reached an absmax of {absmax:.4g} (torch.float32)"
    )
    for out in outs:
        assert all(torch.equal(a, b) for a, b in zip(out, eager, strict=True))
    routers.set_router_limits(strict=True)
    gate.__dict__.pop(routers.LOGITS_ATTR)
    with pytest.raises(cg.RouterLogitsError) as info, torch.no_grad():
        compiled(x)
    assert info.value.router == ROUTER and info.value.call == 1
    cg.restore_linear(model)
    with torch.no_grad():
        compiled(x)  # the graph outlived the router's guard: its op checks nothing
    assert routers.LOGITS_ATTR not in gate.__dict__
