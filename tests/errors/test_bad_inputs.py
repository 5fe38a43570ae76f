"""The bad-input matrix: every way an input or a parameter can be wrong.

Each case checks, on every device the machine has:

* the exact exception class (and the built-in base class existing code catches),
  a message naming the layer and what is wrong, and the error's fields;
* the input is unchanged: its whole storage bitwise (NaN-aware, as raw bytes),
  its version counter (no in-place write at all), shape, strides and offset;
* the parameters are unchanged too;
* the layer is usable afterwards: its output and gradients match ``F.linear``.

Strided and zero-size GOOD inputs (the other half of the matrix) must give
``F.linear``'s result and gradients, without touching the input.
The device-mismatch cases need a GPU and skip cleanly without one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import cublas_guard_ext as cg

from helpers import HAS_CUDA
from helpers.inputs import INF, NAME, NAN, Snapshot, make_layer, randn_with, still_works


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------
def bits(values: list[int], device: str) -> torch.Tensor:
    """float32 values from their IEEE bit patterns."""
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32).to(device)


# --------------------------------------------------------------------------
# The cases
# --------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    id: str
    # (device) -> (layer, input). May also poison the layer's parameters.
    build: Callable[[str], tuple[cg.SafeLinear, Any]]
    error: type[Exception]
    match: str  # a regex searched in str(error)
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    also: tuple[type[Exception], ...] = ()  # the built-in classes it must also be
    limit: int | None = None  # lowered size limit for this case
    cuda_only: bool = False


def _input(shape_or_tensor, dtype=torch.float32):
    """A build function: a fresh layer and an input made on the case's device."""

    def build(device: str):
        if callable(shape_or_tensor):
            x = shape_or_tensor(device)
        else:
            x = torch.ones(shape_or_tensor, dtype=dtype, device=device)
        return make_layer(device), x

    return build


def _poisoned(param: str, index: tuple[int, ...], value: float, x_value: float | None = None):
    """A layer whose weight/bias holds a bad value (set under no_grad: the version bumps)."""

    def build(device: str):
        safe = make_layer(device)
        with torch.no_grad():
            getattr(safe, param)[index] = value
        x = torch.randn(3, 8, device=device)
        if x_value is not None:
            x[2, 5] = x_value
        return safe, x

    return build


def _with_param(param: str, make: Callable[[cg.SafeLinear], torch.Tensor]):
    def build(device: str):
        safe = make_layer(device)
        setattr(safe, param, nn.Parameter(make(safe)))
        return safe, torch.randn(3, 8, device=device)

    return build


def _cuda_layer_with_cpu_bias() -> tuple[cg.SafeLinear, torch.Tensor]:
    safe = make_layer("cuda")
    safe.bias = nn.Parameter(safe.bias.detach().cpu())
    return safe, torch.randn(3, 8, device="cuda")


# A float32 layer: other floating dtypes are a mismatch (nn.Linear refuses them too), the
# rest is no dtype a Linear computes in.
MISMATCHED = [torch.float16, torch.bfloat16, torch.float64]
DTYPES = [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]

CASES: list[Case] = []

# ---- dtype: the input, then the parameters ----
for _dt in DTYPES:
    CASES.append(
        Case(
            f"dtype-input-{str(_dt).removeprefix('torch.')}",
            _input((3, 8), _dt),
            cg.DTypeError,
            rf"input dtype is {re.escape(str(_dt))}, but the guarded linear takes float32, bfloat16, "
            "float16 or float64",
            {"role": "input", "reason": "unsupported"},
            also=(TypeError, RuntimeError),
        )
    )
for _dt in MISMATCHED:
    CASES.append(
        Case(
            f"dtype-input-{str(_dt).removeprefix('torch.')}",
            _input((3, 8), _dt),
            cg.DTypeError,
            rf"input dtype is {re.escape(str(_dt))} but weight dtype is torch\.float32: they must match",
            {"role": "input", "reason": "mismatch", "other_role": "weight"},
            also=(TypeError, RuntimeError),
        )
    )
CASES += [
    Case(
        "dtype-weight-float64",
        _with_param("weight", lambda s: s.weight.detach().double()),
        cg.DTypeError,
        r"input dtype is torch\.float32 but weight dtype is torch\.float64.*"
        r"layer\.to\(torch\.float32\)",
        {"role": "input", "other_dtype": "torch.float64"},
        also=(TypeError, RuntimeError),
    ),
    Case(
        "dtype-weight-float16",
        _with_param("weight", lambda s: s.weight.detach().half()),
        cg.DTypeError,
        r"but weight dtype is torch\.float16",
        {"other_role": "weight"},
    ),
    Case(
        "dtype-bias-float64",
        _with_param("bias", lambda s: s.bias.detach().double()),
        cg.DTypeError,
        r"bias dtype is torch\.float64 but weight dtype is torch\.float32",
        {"role": "bias"},
    ),
]

# ---- shape ----
CASES += [
    Case(
        "shape-last-dim-short",
        _input((3, 7)),
        cg.ShapeMismatchError,
        r"input shape \[3, 7\] has last dim 7, expected in_features = 8",
        {"shape": [3, 7], "expected": 8},
        also=(ValueError, RuntimeError),
    ),
    Case("shape-last-dim-long", _input((3, 9)), cg.ShapeMismatchError, r"has last dim 9", {"shape": [3, 9]}),
    Case(
        "shape-transposed-by-mistake",
        _input(lambda d: torch.randn(3, 8, device=d).t()),
        cg.ShapeMismatchError,
        r"input shape \[8, 3\] has last dim 3",
        {"shape": [8, 3]},
    ),
    Case(
        "shape-0d", _input(()), cg.ShapeMismatchError, r"input is 0-d; expected \[\.\.\., 8\]", {"shape": []}
    ),
    Case(
        "shape-1d-wrong",
        _input((7,)),
        cg.ShapeMismatchError,
        r"input shape \[7\] has last dim 7",
        {"shape": [7]},
    ),
    Case(
        "shape-5d-wrong",
        _input((2, 1, 3, 2, 7)),
        cg.ShapeMismatchError,
        r"input shape \[2, 1, 3, 2, 7\] has last dim 7",
        {"shape": [2, 1, 3, 2, 7]},
    ),
    Case(
        "shape-zero-size-last-dim",
        _input((3, 0)),
        cg.ShapeMismatchError,
        r"has last dim 0",
        {"shape": [3, 0]},
    ),
    Case(
        "shape-zero-batch-wrong-last-dim",
        _input((0, 7)),
        cg.ShapeMismatchError,
        r"input shape \[0, 7\] has last dim 7",
        {"shape": [0, 7]},
    ),
    Case(
        "shape-bias-wrong",
        _with_param("bias", lambda s: torch.zeros(5, device=s.weight.device)),
        cg.ShapeMismatchError,
        r"bias has shape \[5\], expected \[4\]",
        {"role": "bias"},
    ),
    Case(
        "shape-bias-short",
        _with_param("bias", lambda s: torch.zeros(3, device=s.weight.device)),
        cg.ShapeMismatchError,
        r"bias has shape \[3\], expected \[4\]",
        {"role": "bias", "shape": [3]},
    ),
    Case(
        "shape-weight-3d",
        _with_param("weight", lambda s: s.weight.detach()[..., None].clone()),
        cg.ShapeMismatchError,
        r"weight has shape \[4, 8, 1\], expected \[out_features, in_features\]",
        {"role": "weight"},
    ),
]

# ---- values in the input: each kind at the first, middle and last element ----
for _value, _word, _counts in ((NAN, "NaN", (1, 0, 0)), (INF, "+Inf", (0, 1, 0)), (-INF, "-Inf", (0, 0, 1))):
    for _pos, _flat in (("first", 0), ("middle", 21), ("last", 47)):
        CASES.append(
            Case(
                f"value-{_word}-{_pos}",
                _input(lambda d, f=_flat, v=_value: randn_with((6, 8), d, {(f // 8, f % 8): v})),
                cg.NonFiniteInputError,
                rf"input has {_counts[0]} NaN, {_counts[1]} \+Inf, {_counts[2]} -Inf.*"
                rf"flat index {_flat} = x\[{_flat // 8}, {_flat % 8}\] \({re.escape(_word)}\)",
                {
                    "role": "input",
                    "first_bad_index": _flat,
                    "first_bad_coords": [_flat // 8, _flat % 8],
                    "nan_count": _counts[0],
                    "posinf_count": _counts[1],
                    "neginf_count": _counts[2],
                    "shape": [6, 8],
                },
                also=(ValueError,),
            )
        )
CASES += [
    Case(
        "value-mixed",
        _input(lambda d: randn_with((6, 8), d, {(5, 7): NAN, (2, 3): -INF, (4, 0): INF, (5, 0): NAN})),
        cg.NonFiniteInputError,
        r"input has 2 NaN, 1 \+Inf, 1 -Inf.*flat index 19 = x\[2, 3\]",
        {"nan_count": 2, "posinf_count": 1, "neginf_count": 1, "first_bad_index": 19},
    ),
    Case(
        "value-all-nan",
        _input(lambda d: torch.full((4, 8), NAN, device=d)),
        cg.NonFiniteInputError,
        r"input has 32 NaN, 0 \+Inf, 0 -Inf",
        {"nan_count": 32, "first_bad_index": 0},
    ),
    Case(
        "value-nan-payloads",  # negative quiet NaN, signalling NaN, all-ones NaN: all NaN
        _input(
            lambda d: torch.cat(
                [torch.ones(5, device=d), bits([0xFFC00000, 0x7F800001, 0xFFFFFFFF], d)]
            ).view(1, 8)
        ),
        cg.NonFiniteInputError,
        r"input has 3 NaN, 0 \+Inf, 0 -Inf.*flat index 5",
        {"nan_count": 3, "first_bad_index": 5, "first_bad_coords": [0, 5]},
    ),
    Case(
        "value-1d-input",
        _input(lambda d: randn_with((8,), d, {(6,): INF})),
        cg.NonFiniteInputError,
        r"flat index 6 = x\[6\]",
        {"first_bad_coords": [6], "shape": [8]},
    ),
    Case(
        "value-5d-input",
        _input(lambda d: randn_with((2, 1, 3, 2, 8), d, {(1, 0, 2, 1, 7): NAN})),
        cg.NonFiniteInputError,
        r"flat index 95 = x\[1, 0, 2, 1, 7\]",
        {"first_bad_index": 95, "first_bad_coords": [1, 0, 2, 1, 7], "shape": [2, 1, 3, 2, 8]},
    ),
    # ---- values in strided views: indices are logical (row-major over the view) ----
    Case(
        "strided-transposed-nan",
        _input(lambda d: randn_with((8, 5), d, {(6, 2): NAN}).t()),
        cg.NonFiniteInputError,
        r"flat index 22 = x\[2, 6\]",
        {"first_bad_index": 2 * 8 + 6, "first_bad_coords": [2, 6], "shape": [5, 8]},
    ),
    Case(
        "strided-step-slice-inf",
        _input(lambda d: randn_with((5, 16), d, {(3, 14): INF})[:, ::2]),
        cg.NonFiniteInputError,
        r"flat index 31 = x\[3, 7\]",
        {"first_bad_coords": [3, 7]},
    ),
    Case(
        "strided-column-slice-neginf",
        _input(lambda d: randn_with((4, 20), d, {(1, 9): -INF})[:, 5:13]),
        cg.NonFiniteInputError,
        r"flat index 12 = x\[1, 4\]",
        {"first_bad_coords": [1, 4]},
    ),
    Case(
        "strided-expanded-zero-stride",  # one bad storage element = 5 bad logical ones
        _input(lambda d: randn_with((1, 8), d, {(0, 3): NAN}).expand(5, 8)),
        cg.NonFiniteInputError,
        r"input has 5 NaN.*flat index 3 = x\[0, 3\]",
        {"nan_count": 5, "first_bad_index": 3},
    ),
    Case(
        "strided-offset-view",
        _input(lambda d: randn_with((101,), d, {(3 + 37,): NAN})[3:43].view(5, 8)),
        cg.NonFiniteInputError,
        r"flat index 37 = x\[4, 5\]",
        {"first_bad_coords": [4, 5]},
    ),
    Case(
        "strided-permuted-3d",
        _input(lambda d: randn_with((8, 2, 3), d, {(4, 1, 0): INF}).permute(1, 2, 0)),
        cg.NonFiniteInputError,
        r"flat index 28 = x\[1, 0, 4\]",
        {"first_bad_coords": [1, 0, 4]},
    ),
    # ---- values in the parameters ----
    Case(
        "param-weight-nan-first",
        _poisoned("weight", (0, 0), NAN),
        cg.NonFiniteInputError,
        r"weight has 1 NaN, 0 \+Inf, 0 -Inf.*flat index 0 = weight\[0, 0\].*learning rate",
        {"role": "weight", "shape": [4, 8]},
    ),
    Case(
        "param-weight-inf-last",
        _poisoned("weight", (3, 7), INF),
        cg.NonFiniteInputError,
        r"weight has 0 NaN, 1 \+Inf.*flat index 31 = weight\[3, 7\]",
        {"role": "weight"},
    ),
    Case(
        "param-weight-neginf-middle",
        _poisoned("weight", (2, 1), -INF),
        cg.NonFiniteInputError,
        r"weight has 0 NaN, 0 \+Inf, 1 -Inf",
        {"role": "weight", "first_bad_index": 17},
    ),
    Case(
        "param-bias-nan",
        _poisoned("bias", (1,), NAN),
        cg.NonFiniteInputError,
        r"bias has 1 NaN.*flat index 1",
        {"role": "bias", "shape": [4]},
    ),
    Case(
        "param-bias-neginf-last",
        _poisoned("bias", (3,), -INF),
        cg.NonFiniteInputError,
        r"bias has 0 NaN, 0 \+Inf, 1 -Inf",
        {"role": "bias", "first_bad_index": 3},
    ),
    Case(
        "param-weight-and-input",  # both bad: the input is reported (it is checked first)
        _poisoned("weight", (1, 1), NAN, x_value=INF),
        cg.NonFiniteInputError,
        r"input has 0 NaN, 1 \+Inf",
        {"role": "input", "first_bad_coords": [2, 5]},
    ),
    # ---- sizes near cuBLAS's 32-bit limits: the limit lowered to 20, and no 64-bit API (what a
    # cuBLAS older than 12 offers). The batch (n) and the reduction (k) are split into pieces,
    # and an operand whose stride is beyond the limit is copied into the layout that fits;
    # m (out_features, also ldc) cannot be, so it is refused. (With the 64-bit API all of
    # these work: see test_beyond_the_limit_with_the_64bit_api.) ----
    Case(
        "size-out-features",
        lambda d: (cg.SafeLinear(8, 21, device=d, name=NAME), torch.randn(2, 8, device=d)),
        cg.SizeLimitError,
        r"argument m = 21 exceeds cuBLAS's 32-bit limit 20",
        {"argument": "m", "value": 21, "limit": 20},
        also=(ValueError,),
        limit=20,
    ),
    Case(
        "size-out-features-3d",
        lambda d: (cg.SafeLinear(4, 25, device=d, name=NAME), torch.randn(2, 3, 4, device=d)),
        cg.SizeLimitError,
        r"argument m = 25",
        {"argument": "m", "value": 25},
        limit=20,
    ),
    # ---- devices ----
    Case(
        "device-meta-input",
        _input(lambda d: torch.randn(3, 8, device="meta")),
        cg.DeviceMismatchError,
        r"input is on meta but the layer's weight is on",
        {"role": "input"},
        also=(ValueError, RuntimeError),
    ),
    Case(
        "device-cpu-input-cuda-layer",
        lambda d: (make_layer("cuda"), torch.randn(3, 8)),
        cg.DeviceMismatchError,
        r"input is on cpu but the layer's weight is on cuda",
        {"input_device": "cpu"},
        cuda_only=True,
    ),
    Case(
        "device-cuda-input-cpu-layer",
        lambda d: (make_layer("cpu"), torch.randn(3, 8, device="cuda")),
        cg.DeviceMismatchError,
        r"input is on cuda:0 but the layer's weight is on cpu",
        {"weight_device": "cpu"},
        cuda_only=True,
    ),
    Case(
        "device-bias-on-cpu",
        lambda d: _cuda_layer_with_cpu_bias(),
        cg.DeviceMismatchError,
        r"bias is on cpu but the layer's weight is on cuda",
        {"role": "bias"},
        cuda_only=True,
    ),
]


def _ids() -> list[str]:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    return ids


def test_the_matrix_is_big_enough() -> None:
    assert len(CASES) >= 40, len(CASES)


def _repair(safe: cg.SafeLinear, device: str) -> None:
    """Give the layer clean float32 parameters of the right shape on one device, in place
    where possible (so the same Parameter objects are kept, as an optimizer would)."""
    fixed = cg.SafeLinear(
        safe.in_features,
        safe.out_features,
        bias=safe.bias is not None,
        device=safe.weight.device if safe.weight.device.type != "meta" else device,
    )
    for name in ("weight", "bias"):
        current, good = getattr(safe, name), getattr(fixed, name)
        if current is None:
            continue
        if current.shape == good.shape and current.dtype == good.dtype and current.device == good.device:
            with torch.no_grad():
                current.copy_(good)
        else:
            setattr(safe, name, good)


@pytest.mark.parametrize("case", CASES, ids=_ids())
def test_bad_input(device: str, case: Case, size_limit) -> None:
    if case.cuda_only and not HAS_CUDA:
        pytest.skip("needs a CUDA GPU and the CUDA build")
    if case.cuda_only and device != "cuda":
        pytest.skip("device-mismatch cases run once, under the cuda parametrization")
    safe, x = case.build(device)
    before = Snapshot.of(x)
    params_before = {n: Snapshot.of(p) for n, p in safe.named_parameters()}
    if case.limit is not None:
        size_limit(case.limit, allow_64bit=False)

    with pytest.raises(case.error, match=re.compile(case.match, re.S)) as info:
        safe(x)
    err = info.value
    assert type(err) is case.error, f"{type(err).__name__} is a subclass, not the class itself"
    assert isinstance(err, cg.GuardError)
    for base in case.also:
        assert isinstance(err, base), f"{type(err).__name__} must also be a {base.__name__}"
    assert err.layer == NAME and f"'{NAME}'" in str(err), "the message names the layer"
    for key, value in case.fields.items():
        got = getattr(err, key)
        if isinstance(value, str) and key.endswith("device"):
            assert str(got).startswith(value), (key, got, value)
        else:
            assert got == value, (key, got, value)
    assert "Next: " in str(err), "every error says what to do next"

    before.assert_same(x)
    for n, p in safe.named_parameters():
        params_before[n].assert_same(p, what=n)

    # The layer is usable afterwards (parameters repaired when they were the problem).
    if case.limit is not None:
        if max(safe.in_features, safe.out_features) <= case.limit:
            still_works(safe, batch=(2,))  # a contiguous input: works under the lowered limit
        size_limit(case.limit, allow_64bit=True)
        still_works(safe, batch=(case.limit + 5,))  # with the 64-bit API (and splitting) it works
        size_limit(2**31 - 1)  # back to cuBLAS's real limit (the fixture restores it anyway)
    if case.id.startswith(
        ("param-", "dtype-weight", "dtype-bias", "shape-bias", "shape-weight", "device-bias")
    ):
        _repair(safe, device)
    still_works(safe)
    still_works(safe, batch=(2, 3))


def test_errors_reach_the_same_layer_twice(device: str) -> None:
    """A failing call leaves nothing behind: the same bad input raises the same error again,
    and a good call in between is unaffected."""
    safe = make_layer(device)
    x = randn_with((4, 8), device, {(3, 1): NAN})
    messages = []
    for _ in range(3):
        with pytest.raises(cg.NonFiniteInputError) as info:
            safe(x)
        messages.append(str(info.value))
        still_works(safe)
    assert messages[0] == messages[1] == messages[2]
