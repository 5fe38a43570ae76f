"""What the guarded grouped GEMM refuses, and how it names the place: the experts module, the
expert and the parameter, with the counts and first bad element (non-finite values), the
failing expert's GEMM with a capsule (cuBLAS failures), and a typed error for every bad
argument, raised before anything is computed."""

from __future__ import annotations

import pytest
import torch

import cublas_guard_ext as cg
from cublas_guard_ext.models.experts import grouped_linear

from helpers import moe_models as mm

MODULE = "model.layers.0.mlp.experts"


def operands(rows=10, ends=(3, 3, 8), transposed=False, dtype=torch.float32):
    x = torch.randn(rows, 6, dtype=dtype)
    w = torch.randn((3, 6, 5) if transposed else (3, 5, 6), dtype=dtype)
    return x, w, torch.randn(3, 5, dtype=dtype), torch.tensor(ends, dtype=torch.int32)


def call(x, w, offs, b=None, **kw):
    return grouped_linear(x, w, offs, b, layer=MODULE, parameter="gate_up_proj", **kw)


# -- non-finite values: the expert named -------------------------------------------------------------------
def test_a_nan_in_one_experts_weight_names_that_expert() -> None:
    x, w, b, offs = operands()
    w[2, 1, 4] = float("nan")
    w[2, 3, 0] = float("inf")
    with pytest.raises(cg.NonFiniteInputError) as info:
        call(x, w, offs, b)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.layer == f"{MODULE}.gate_up_proj[2]" and err.role == "weight"
    assert (err.experts_module, err.expert, err.parameter, err.expert_rows) == (
        MODULE,
        2,
        "gate_up_proj",
        [3, 8],
    )
    assert (err.nan_count, err.posinf_count, err.first_bad_coords) == (1, 1, [2, 1, 4])
    text = str(err)
    assert text.splitlines()[0] == (f"layer '{MODULE}.gate_up_proj[2]': weight has 1 NaN, 1 +Inf, 0 -Inf")
    assert f"in expert 2 of '{MODULE}', parameter gate_up_proj (gate_up_proj[2])" in text
    assert "the expert's rows of the sorted input are 3..7 (5 rows)" in text
    assert "first bad element: flat index 70 = weight[2, 1, 4] (NaN)" in text


def test_a_nan_in_an_expert_no_token_went_to_is_still_refused() -> None:
    x, w, b, offs = operands()
    w[1, 0, 0] = float("nan")
    with pytest.raises(cg.NonFiniteInputError, match=r"gate_up_proj\[1\]") as info:
        call(x, w, offs, b)
    assert "no row was routed to it" in str(info.value)


def test_a_nan_in_a_routed_row_names_the_expert_of_that_row() -> None:
    x, w, b, offs = operands()
    x[5, 2] = float("-inf")
    with pytest.raises(cg.NonFiniteInputError) as info:
        call(x, w, offs, b)
    err = info.value
    assert (err.role, err.expert, err.first_bad_coords, err.neginf_count) == ("input", 2, [5, 2], 1)
    assert err.layer == f"{MODULE}.gate_up_proj[2]"


def test_a_nan_in_the_bias_names_its_expert() -> None:
    x, w, b, offs = operands()
    b[0, 3] = float("nan")
    with pytest.raises(cg.NonFiniteInputError) as info:
        call(x, w, offs, b)
    assert (info.value.role, info.value.expert, info.value.first_bad_coords) == ("bias", 0, [0, 3])


def test_a_nan_in_a_models_expert_is_refused_there_not_at_the_next_layer() -> None:
    """Unguarded experts pass the NaN on: the next guarded layer (the next attention's q_proj)
    refuses it, naming the wrong place; guarded, the experts module and the expert are named."""
    model = mm.mixtral()
    cg.replace_linear(model)  # routers guarded too: no warning
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj[3, 2, 1] = float("nan")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.set_experts_implementation("grouped_mm")  # as before the guard: the wrong place
    with pytest.raises(cg.NonFiniteInputError) as info:
        model(torch.tensor([list(range(0, 64, 4))]))
    assert info.value.layer == "model.layers.1.self_attn.q_proj"
    model.set_experts_implementation("cublas_guard")
    with pytest.raises(cg.NonFiniteInputError) as info:
        model(torch.tensor([list(range(0, 64, 4))]))
    err = info.value
    assert (err.experts_module, err.parameter, err.expert, err.role) == (MODULE, "down_proj", 3, "weight")
    assert err.layer == f"{MODULE}.down_proj[3]" and err.first_bad_coords == [3, 2, 1]
    # nothing was updated: the parameters are as they were and no gradient was made
    assert all(torch.equal(p.nan_to_num(), before[n].nan_to_num()) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


# -- cuBLAS failures: the failing expert's call, a capsule ---------------------------------------------------
def test_a_failing_gemm_names_the_expert_and_its_call(inject_fault) -> None:
    x, w, b, offs = operands(ends=(0, 0, 8))  # only expert 2 has rows: the first GEMM is its
    inject_fault("gemm", 13)
    with pytest.raises(cg.CublasError) as info:
        call(x, w, offs, b)
    err = info.value
    assert err.layer == f"{MODULE}.gate_up_proj[2]" and (err.expert, err.parameter) == (2, "gate_up_proj")
    assert err.expert_rows == [0, 8] and err.purpose == "forward"
    assert (err.m, err.n, err.k) == (5, 8, 6)  # out_features x the expert's rows, over in_features
    assert err.status_name == "CUBLAS_STATUS_EXECUTION_FAILED"
    assert f"in expert 2 of '{MODULE}', parameter gate_up_proj" in str(err)
    assert err.capsule is not None
    data = cg.capsule.load(err.capsule)
    assert data["layer"] == f"{MODULE}.gate_up_proj[2]" and data["fields"]["expert"] == 2
    assert data["call"]["m"] == 5 and data["call"]["n"] == 8 and data["values"] == "values"
    assert torch.equal(data["gemm_operands"]["b"]["values"].view(8, 6), x[:8])


@pytest.mark.parametrize("which", ["grad_input", "grad_weight"])
def test_a_failing_backward_gemm_names_the_expert(inject_fault, which) -> None:
    x, w, b, offs = operands(ends=(0, 4, 8))
    x.requires_grad_(which == "grad_input")
    w.requires_grad_(which == "grad_weight")
    out = call(x, w, offs, b, mode="off")
    inject_fault("gemm", 14)
    with pytest.raises(cg.CublasError) as info:
        out.sum().backward()
    err = info.value
    assert (err.purpose, err.expert, err.layer) == (which, 1, f"{MODULE}.gate_up_proj[1]")
    assert err.capsule is not None and cg.capsule.load(err.capsule)["phase"] == which


@pytest.mark.slow
def test_the_failing_experts_capsule_replays(inject_fault) -> None:
    x, w, b, offs = operands(ends=(2, 2, 7))
    inject_fault("gemm", 13)
    with pytest.raises(cg.CublasError) as info:
        call(x, w, offs, b)
    assert info.value.expert == 0
    result = cg.replay(info.value.capsule)
    assert result["ran"] is True and result["reproduced"] is False  # the one fault was used up
    assert result["call"]["n"] == 2  # the expert's rows alone
    assert result["variants"][0]["status"] == "passed"


# -- bad arguments: typed, before anything ran ---------------------------------------------------------------
@pytest.mark.parametrize(
    "ends,reason,expert,headline",
    [
        (
            (3, 2, 8),
            "descending",
            1,
            "the group offsets are not ascending: expert 1 ends at row 2, before expert 0's end 3",
        ),
        ((-1, 2, 8), "negative", 0, "the group offsets start at -1 (negative)"),
        ((3, 3, 11), "past_tokens", 2, "expert 2's group ends at row 11, past the input's 10 rows"),
    ],
)
def test_offsets_that_do_not_make_groups_are_refused(ends, reason, expert, headline) -> None:
    x, w, b, offs = operands(ends=ends)
    with pytest.raises(cg.errors.GroupOffsetsError) as info:
        call(x, w, offs, b)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.reason, err.expert, err.offsets, err.num_tokens) == (reason, expert, list(ends), 10)
    assert str(err).splitlines()[0] == f"layer '{MODULE}.gate_up_proj': {headline}"
    assert "nothing was computed" in str(err)


def test_float_offsets_are_refused() -> None:
    x, w, b, offs = operands()
    with pytest.raises(cg.errors.GroupOffsetsError) as info:
        call(x, w, offs.float(), b)
    assert isinstance(info.value, ValueError) and info.value.reason == "dtype"
    assert "torch.float32; they must be int32" in str(info.value)


def test_an_expert_count_that_does_not_match_the_weights_is_refused() -> None:
    x, w, b, _ = operands()
    with pytest.raises(cg.ShapeMismatchError) as info:
        call(x, w, torch.tensor([3, 8], dtype=torch.int32), b)
    assert info.value.role == "offsets"
    assert info.value.expected == "[3] (one group end per expert of the weight)"


@pytest.mark.parametrize(
    "change,error,role",
    [
        (lambda x, w, b: (x.double(), w, b), cg.DTypeError, "input"),
        (lambda x, w, b: (x, w, b.half()), cg.DTypeError, "bias"),
        (lambda x, w, b: (x[:, :5], w, b), cg.ShapeMismatchError, "input"),
        (lambda x, w, b: (x, w[0], b), cg.ShapeMismatchError, "weight"),
        (lambda x, w, b: (x, w, b[:2]), cg.ShapeMismatchError, "bias"),
        (lambda x, w, b: (x.int(), w, b), cg.DTypeError, "input"),
    ],
    ids=["input_dtype", "bias_dtype", "in_features", "weight_2d", "bias_experts", "int_input"],
)
def test_mixed_dtypes_and_shapes_are_refused(change, error, role) -> None:
    x, w, b, offs = operands()
    x, w, b = change(x, w, b)
    with pytest.raises(error) as info:
        call(x, w, offs, b)
    assert info.value.role == role and info.value.layer == f"{MODULE}.gate_up_proj"


def test_mixed_devices_are_refused() -> None:
    x, w, b, offs = operands()
    with pytest.raises(cg.DeviceMismatchError) as info:
        call(x, w.to("meta"), offs, b.to("meta"))
    assert info.value.role == "input" and info.value.weight_device == "meta"
    with pytest.raises(cg.DeviceMismatchError) as info:
        call(x, w, offs.to("meta"), b)
    assert info.value.role == "offsets"


def test_the_meta_kernel_refuses_what_the_cpu_kernel_refuses() -> None:
    """torch.compile and torch.export trace the Meta kernel: the same rules, the same errors."""
    x, w, b, _ = operands()
    bad = torch.tensor([3, 8], dtype=torch.int32)
    for device in ("cpu", "meta"):
        with pytest.raises(cg.ShapeMismatchError, match="one group end per expert"):
            call(x.to(device), w.to(device), bad.to(device), b.to(device))
    out = call(x.to("meta"), w.to("meta"), torch.tensor([3, 3, 8], dtype=torch.int32, device="meta"))
    assert out.shape == (10, 5) and out.device.type == "meta"
