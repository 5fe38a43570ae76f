"""Every floating dtype nn.Linear takes: float32, bfloat16, float16, float64.

Parity with nn.Linear in the same dtype and with a float64 reference (forward and
backward, with and without bias), the scan per dtype against isnan/isinf, each bad
dtype's exact error, the routines named in reports, opcheck and torch.compile per
dtype, gradcheck/gradgradcheck in float64, and torch.autocast on CPU (and CUDA).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cublas_guard_ext as cg

from helpers import CUBLAS_STATUSES, HAS_CUDA, assert_matches, max_rel_error, requires_cuda

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
IDS = [str(d).removeprefix("torch.") for d in DTYPES]
# max |safe - nn.Linear| / max |nn.Linear|, same dtype: float32 and float64 may differ
# only in summation order; bf16/fp16 by about one rounding of the output (2^-8, 2^-11)
# plus the order in which a long sum was rounded.
PARITY = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 3e-3}
# What each format's routine is called, per device (the native backends' names).
ROUTINE = {
    "cpu": {d: ("torch CPU addmm", "torch CPU addmm") for d in DTYPES},
    "cuda": {
        torch.float32: ("cublasSgemm", "cublasSgemm_64"),
        torch.bfloat16: ("cublasGemmEx", "cublasGemmEx_64"),
        torch.float16: ("cublasGemmEx", "cublasGemmEx_64"),
        torch.float64: ("cublasDgemm", "cublasDgemm_64"),
    },
}
DATA_TYPE = {
    "cpu": {
        torch.float32: "float32",
        torch.bfloat16: "bfloat16",
        torch.float16: "float16",
        torch.float64: "float64",
    },
    "cuda": {
        torch.float32: "CUDA_R_32F",
        torch.bfloat16: "CUDA_R_16BF",
        torch.float16: "CUDA_R_16F",
        torch.float64: "CUDA_R_64F",
    },
}


def pair(in_f: int, out_f: int, bias: bool, device: str, dtype: torch.dtype):
    ref = nn.Linear(in_f, out_f, bias=bias, device=device, dtype=dtype)
    safe = cg.SafeLinear(in_f, out_f, bias=bias, device=device, dtype=dtype, name="typed")
    safe.load_state_dict(ref.state_dict())
    return ref, safe


def within_reference(actual: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, dtype) -> None:
    """No further from the float64 truth than 2x nn.Linear's own error plus a few ulps."""
    eps = 4 * torch.finfo(dtype).eps
    assert max_rel_error(actual, truth) <= 2 * max_rel_error(ref, truth) + eps


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(9, 24), (3, 5, 24)], ids=["2d", "3d"])
def test_forward_and_backward_match_nn_linear(device: str, dtype, bias: bool, shape) -> None:
    ref, safe = pair(24, 11, bias, device, dtype)
    x = torch.randn(shape, device=device, dtype=dtype)
    x_ref, x_safe = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_safe = ref(x_ref), safe(x_safe)
    assert y_safe.dtype == dtype
    assert_matches(y_safe, y_ref, rel=PARITY[dtype])
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    y_safe.backward(g)
    grads = [(x_safe.grad, x_ref.grad), (safe.weight.grad, ref.weight.grad)]
    if bias:
        grads.append((safe.bias.grad, ref.bias.grad))
    for got, want in grads:
        assert got.dtype == dtype
        assert_matches(got, want, rel=PARITY[dtype])

    # float64 truth from the same (rounded) operands
    w64 = ref.weight.detach().double()
    b64 = ref.bias.detach().double() if bias else None
    y64 = F.linear(x.double(), w64, b64)
    within_reference(y_safe, y_ref, y64, dtype)
    g64 = g.double()
    within_reference(x_safe.grad, x_ref.grad, g64 @ w64, dtype)
    within_reference(
        safe.weight.grad, ref.weight.grad, g64.reshape(-1, 11).t() @ x.double().reshape(-1, 24), dtype
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_transposed_and_sliced_inputs(device: str, dtype) -> None:
    ref, safe = pair(13, 7, True, device, dtype)
    for x in (
        torch.randn(13, 9, device=device, dtype=dtype).t(),
        torch.randn(9, 40, device=device, dtype=dtype)[:, 3:16],
        torch.randn(9, 40, device=device, dtype=dtype)[:, ::3][:, :13],
    ):
        assert_matches(safe(x), ref(x), rel=PARITY[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_functional_linear_per_dtype(device: str, dtype) -> None:
    x = torch.randn(6, 10, device=device, dtype=dtype)
    w = torch.randn(4, 10, device=device, dtype=dtype)
    b = torch.randn(4, device=device, dtype=dtype)
    assert_matches(cg.linear(x, w, b, mode="sync"), F.linear(x, w, b), rel=PARITY[dtype])


# ---------------------------------------------------------------------------
# The scan per dtype
# ---------------------------------------------------------------------------
def reference_counts(x: torch.Tensor) -> tuple[int, int, int, int]:
    flat = x.reshape(-1)
    nan, posinf, neginf = flat.isnan(), flat == float("inf"), flat == float("-inf")
    bad = (nan | posinf | neginf).nonzero()
    first = int(bad[0]) if bad.numel() else -1
    return int(nan.sum()), int(posinf.sum()), int(neginf.sum()), first


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 4095, 4096 * 3 + 5, 70001])
def test_scan_matches_isnan_isinf(device: str, dtype, n: int) -> None:
    x = torch.randn(n, device=device, dtype=dtype)
    r = cg.scan(x)
    assert (r.nan_count, r.posinf_count, r.neginf_count, r.first_bad_index) == (0, 0, 0, -1)
    # Planted at the first and last element, and a few in between.
    x[-1] = float("-inf")
    x[0] = float("nan")
    if n > 8:
        x[n // 2] = float("inf")
        x[n // 3] = float("nan")
    r = cg.scan(x)
    assert (r.nan_count, r.posinf_count, r.neginf_count, r.first_bad_index) == reference_counts(x)
    # Only the last one: the first index is the last element.
    y = torch.randn(n, device=device, dtype=dtype)
    y[-1] = float("inf")
    assert cg.scan(y).first_bad_index == n - 1


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_scan_extremes_are_finite(device: str, dtype) -> None:
    """The largest finite value, the smallest subnormal and -0 are finite in every format."""
    info = torch.finfo(dtype)
    x = torch.tensor(
        [info.max, -info.max, info.tiny, info.smallest_normal / 4, -0.0, 0.0] * 5, device=device, dtype=dtype
    )
    assert cg.scan(x).all_finite


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_scan_strided_views(device: str, dtype) -> None:
    base = torch.randn(64, 33, device=device, dtype=dtype)
    base[5, 7] = float("nan")
    base[40, 2] = float("-inf")
    for view in (base.t(), base[:, ::2], base[3:, 1:30], base.unsqueeze(0).expand(3, 64, 33)):
        r = cg.scan(view)
        assert (r.nan_count, r.posinf_count, r.neginf_count, r.first_bad_index) == reference_counts(view)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_check_features_and_layers_report_per_dtype(device: str, dtype) -> None:
    x = torch.randn(4, 6, device=device, dtype=dtype)
    cg.check_features(x, 6, name="feat")
    x[2, 3] = float("nan")
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check_features(x, 6, name="feat")
    assert info.value.first_bad_coords == [2, 3] and info.value.nan_count == 1
    layer = cg.SafeLinear(6, 3, device=device, dtype=dtype, name="typed")
    with pytest.raises(cg.NonFiniteInputError, match="layer 'typed'"):
        layer(x)


# ---------------------------------------------------------------------------
# Bad dtypes: each one's exact error
# ---------------------------------------------------------------------------
MIXED = [(x, w) for x in DTYPES for w in DTYPES if x != w]


@pytest.mark.parametrize("x_dtype,w_dtype", MIXED, ids=[f"{x}-into-{w}" for x, w in MIXED])
def test_input_and_weight_of_different_dtypes_raise_naming_both(device: str, x_dtype, w_dtype) -> None:
    layer = cg.SafeLinear(8, 3, device=device, dtype=w_dtype, name="mixed")
    x = torch.randn(2, 8, device=device, dtype=x_dtype)
    with pytest.raises(RuntimeError):  # nn.Linear refuses them too
        nn.Linear(8, 3, device=device, dtype=w_dtype)(x)
    with pytest.raises(cg.DTypeError) as info:
        layer(x)
    err = info.value
    assert isinstance(err, TypeError) and isinstance(err, RuntimeError)
    assert err.role == "input" and err.other_role == "weight" and err.reason == "mismatch"
    assert err.dtype == str(x_dtype) and err.other_dtype == str(w_dtype)
    assert f"input dtype is {x_dtype} but weight dtype is {w_dtype}" in str(err)
    assert f"x = x.to({w_dtype})" in str(err)


def test_bias_of_another_dtype_is_refused(device: str) -> None:
    layer = cg.SafeLinear(8, 3, device=device, dtype=torch.bfloat16, name="b")
    layer.bias = nn.Parameter(layer.bias.detach().float())
    with pytest.raises(
        cg.DTypeError, match=r"bias dtype is torch\.float32 but weight dtype is torch\.bfloat16"
    ):
        layer(torch.randn(2, 8, device=device, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "dtype", [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
)
def test_integer_bool_complex_inputs_raise(device: str, dtype) -> None:
    layer = cg.SafeLinear(8, 3, device=device, name="ints")
    x = torch.ones(2, 8, device=device, dtype=dtype)
    with pytest.raises(cg.DTypeError) as info:
        layer(x)
    err = info.value
    assert err.role == "input" and err.reason == "unsupported" and err.dtype == str(dtype)
    assert (
        f"input dtype is {dtype}, but the guarded linear takes float32, bfloat16, float16 or float64"
        in str(err)
    )
    with pytest.raises(cg.DTypeError):
        cg.check_features(x, 8)
    with pytest.raises(TypeError, match="float32, bfloat16, float16 or float64"):
        cg.scan(x)


def test_unsupported_weight_dtype_raises(device: str) -> None:
    w = torch.ones(3, 8, device=device, dtype=torch.int32)
    with pytest.raises(cg.DTypeError, match=r"weight dtype is torch\.int32") as info:
        cg.linear(torch.ones(2, 8, device=device), w)
    assert info.value.role == "weight"


def test_cpu_dtype_messages_name_what_the_cpu_runs() -> None:
    """On the CPU nothing says cuBLAS or 'float32-only': the CPU runs torch's addmm."""
    layer = cg.SafeLinear(8, 3, name="cpu")
    for x in (torch.ones(2, 8, dtype=torch.int64), torch.ones(2, 8, dtype=torch.bfloat16)):
        with pytest.raises(cg.DTypeError) as info:
            layer(x)
        text = str(info.value)
        assert "cublas" not in text.lower() and "float32-only" not in text
        assert "torch's CPU addmm" in text


@requires_cuda
def test_cuda_dtype_messages_name_the_cuda_routines() -> None:
    layer = cg.SafeLinear(8, 3, device="cuda", name="gpu")
    with pytest.raises(cg.DTypeError) as info:
        layer(torch.ones(2, 8, device="cuda", dtype=torch.int64))
    assert "cublasGemmEx" in str(info.value) and "cublasDgemm" in str(info.value)


# ---------------------------------------------------------------------------
# Reports name the routine, the data type and the compute type; splitting per dtype
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_failure_reports_name_routine_and_types(device: str, dtype, inject_fault) -> None:
    layer = cg.SafeLinear(8, 3, device=device, dtype=dtype, name="faulty")
    inject_fault("gemm", 13)
    with pytest.raises(cg.CublasError) as info:
        layer(torch.randn(4, 8, device=device, dtype=dtype))
    err = info.value
    routine = ROUTINE[device][dtype][0]
    assert err.api == routine and err.data_type == DATA_TYPE[device][dtype]
    assert (
        err.compute_type == ("float64" if device == "cpu" else "CUBLAS_COMPUTE_64F")
        if dtype == torch.float64
        else err.compute_type in ("float32", "CUBLAS_COMPUTE_32F")
    )
    assert err.status_name == CUBLAS_STATUSES[13]
    assert f"from {routine}" in str(err) and f"data type: {DATA_TYPE[device][dtype]}" in str(err)
    assert_matches(
        layer(torch.ones(2, 8, device=device, dtype=dtype)),
        F.linear(torch.ones(2, 8, device=device, dtype=dtype), layer.weight, layer.bias),
        rel=PARITY[dtype],
    )  # the next call works


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_split_and_64bit_per_dtype(device: str, dtype, size_limit, inject_fault) -> None:
    """Past a lowered 32-bit limit: the batch is split (same result), and an m that
    cannot be split takes the dtype's 64-bit routine."""
    ref, safe = pair(6, 5, True, device, dtype)
    x = torch.randn(23, 6, device=device, dtype=dtype, requires_grad=True)
    want = ref(x)
    want.sum().backward()
    want_grads = (x.grad.clone(), ref.weight.grad.clone())
    x.grad = None
    size_limit(7)
    got = safe(x)
    got.sum().backward()
    assert_matches(got, want, rel=PARITY[dtype])
    assert_matches(x.grad, want_grads[0], rel=PARITY[dtype])
    # grad_weight's reduction runs over the batch (k = 23): split, its pieces accumulate
    # with beta = 1 in the output dtype, one rounding per piece. In float32/64 that stays
    # within nn.Linear's tolerance; in bf16/fp16 nn.Linear's single rounding is no
    # reference (they differ by up to ~2.5% of the max): there the bound for a sum
    # rounded after each of at most k terms holds, against the exact (float64) product:
    # |error| <= k * eps * (|g|^T |x|), elementwise. (The split itself is dtype-blind:
    # the float32 case checks it tightly.)
    if dtype in (torch.float32, torch.float64):
        assert_matches(safe.weight.grad, want_grads[1], rel=PARITY[dtype])
    else:
        g = torch.ones_like(got).double()
        exact = g.t() @ x.detach().double()
        bound = x.shape[0] * torch.finfo(dtype).eps * (g.t() @ x.detach().double().abs())
        assert (safe.weight.grad.double() - exact).abs().le(bound).all()
    wide = cg.SafeLinear(6, 9, device=device, dtype=dtype, name="wide")  # m = 9 > 7: 64-bit API
    inject_fault("gemm", 13)
    with pytest.raises(cg.CublasError) as info:
        wide(torch.randn(3, 6, device=device, dtype=dtype))
    assert info.value.api == ROUTINE[device][dtype][1]


# ---------------------------------------------------------------------------
# opcheck, torch.compile, gradcheck
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_opcheck_per_dtype(dtype) -> None:
    def t(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)

    ops = torch.ops.cublas_guard
    cases = [
        (ops.scan.default, (torch.randn(7, 3, dtype=dtype),)),
        (ops.linear.default, (t(4, 5), t(3, 5), t(3), "l", 1, False)),
        (ops.linear.default, (t(2, 4, 5), t(3, 5), None, "l", 2, True)),
        (ops.linear_grad_input.default, (t(4, 3), t(3, 5), "l")),
        (ops.linear_grad_weight.default, (t(4, 3), t(4, 5), "l")),
        (ops.check_features.default, (torch.randn(4, 5, dtype=dtype), 5, "l")),
    ]
    # gradcheck inside opcheck needs float64; lower precisions check schema, fake and autograd registration
    tests = (
        None
        if dtype == torch.float64
        else ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    )
    for op, args in cases:
        result = (
            torch.library.opcheck(op, args, test_utils=tests) if tests else torch.library.opcheck(op, args)
        )
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


def test_meta_kernels_propagate_dtypes() -> None:
    for dtype in DTYPES:
        x = torch.empty(2, 3, 5, device="meta", dtype=dtype)
        w = torch.empty(4, 5, device="meta", dtype=dtype)
        out = torch.ops.cublas_guard.linear(x, w, None, "m", 0, False)
        assert out.dtype == dtype and out.shape == (2, 3, 4) and out.device.type == "meta"
        gi = torch.ops.cublas_guard.linear_grad_input(
            torch.empty(2, 3, 4, device="meta", dtype=dtype), w, "m"
        )
        assert gi.dtype == dtype and gi.shape == (2, 3, 5)
        gw = torch.ops.cublas_guard.linear_grad_weight(
            torch.empty(2, 3, 4, device="meta", dtype=dtype), x, "m"
        )
        assert gw.dtype == dtype and gw.shape == (4, 5)
    with pytest.raises(cg.DTypeError, match=r"but weight dtype is torch\.float32"):
        torch.ops.cublas_guard.linear(
            torch.empty(2, 5, device="meta", dtype=torch.bfloat16),
            torch.empty(4, 5, device="meta"),
            None,
            "m",
            0,
            False,
        )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_torch_compile_per_dtype(dtype) -> None:
    torch._dynamo.reset()
    model = cg.replace_linear(
        nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(dtype), mode="async"
    )
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(5, 8, dtype=dtype, requires_grad=True)
    eager = model(x)
    eager.float().square().sum().backward()
    eager_grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    out = compiled(x)
    out.float().square().sum().backward()
    assert out.dtype == dtype
    assert_matches(out, eager, rel=PARITY[dtype])
    for got, want in zip([x.grad] + [p.grad for p in model.parameters()], eager_grads):
        assert_matches(got, want, rel=PARITY[dtype])


@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck_and_gradgradcheck_float64(device: str, bias: bool) -> None:
    layer = cg.SafeLinear(5, 3, bias=bias, device=device, dtype=torch.float64, name="gc")
    x = torch.randn(4, 5, device=device, dtype=torch.float64, requires_grad=True)
    params = (layer.weight,) + ((layer.bias,) if bias else ())

    def fn(x, w, *b):
        return cg.linear(x, w, b[0] if b else None, layer="gc")

    assert torch.autograd.gradcheck(fn, (x,) + params)
    assert torch.autograd.gradgradcheck(fn, (x,) + params)


# ---------------------------------------------------------------------------
# torch.autocast: SafeLinear casts exactly as nn.Linear does there
# ---------------------------------------------------------------------------
def autocast_pair(device: str, dtype_model=torch.float32):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(device, dtype_model)
    safe = cg.replace_linear(
        nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(device, dtype_model)
    )
    safe.load_state_dict(ref.state_dict())
    return ref, safe


AUTOCAST_CASES = [("cpu", torch.bfloat16), ("cpu", torch.float16)] + (
    [("cuda", torch.float16), ("cuda", torch.bfloat16)] if HAS_CUDA else []
)


@pytest.mark.parametrize("device,amp_dtype", AUTOCAST_CASES, ids=[f"{d}-{t}" for d, t in AUTOCAST_CASES])
def test_autocast_matches_nn_linear(device: str, amp_dtype) -> None:
    ref, safe = autocast_pair(device)
    x = torch.randn(6, 16, device=device)
    with torch.autocast(device, dtype=amp_dtype):
        y_ref = ref(x)
        y_safe = safe(x)
        # the product of another op in the autocast dtype reaches a SafeLinear directly
        h = torch.randn(6, 32, device=device).to(amp_dtype)
        z_ref, z_safe = ref[2](h), safe[2](h)
    assert y_safe.dtype == y_ref.dtype == amp_dtype
    assert z_safe.dtype == z_ref.dtype == amp_dtype
    assert_matches(y_safe, y_ref, rel=PARITY[amp_dtype])
    assert_matches(z_safe, z_ref, rel=PARITY[amp_dtype])
    y_ref.float().square().sum().backward()
    y_safe.float().square().sum().backward()
    for p_safe, p_ref in zip(safe.parameters(), ref.parameters()):
        assert p_safe.grad.dtype == torch.float32  # gradients reach the fp32 parameters
        assert_matches(p_safe.grad, p_ref.grad, rel=2 * PARITY[amp_dtype])


def test_autocast_follows_the_runtime_dtype_and_leaves_float64_alone() -> None:
    layer = cg.SafeLinear(4, 2, name="amp")
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert layer(x).dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert layer(x).dtype == torch.float32
    assert layer(x).dtype == torch.float32
    ref64, safe64 = autocast_pair("cpu", torch.float64)
    x64 = torch.randn(3, 16, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float64 is not eligible: stays float64
        out_ref, out_safe = ref64(x64), safe64(x64)
    assert out_safe.dtype == out_ref.dtype == torch.float64
    assert_matches(out_safe, out_ref, rel=PARITY[torch.float64])


def test_autocast_scan_reports_non_finite_by_layer() -> None:
    _, safe = autocast_pair("cpu")
    x = torch.randn(6, 16)
    x[1, 2] = float("inf")
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(cg.NonFiniteInputError, match="layer '0'") as info,
    ):
        safe(x)
    assert info.value.first_bad_coords == [1, 2] and info.value.posinf_count == 1


@pytest.mark.slow
def test_autocast_under_compile() -> None:
    torch._dynamo.reset()
    ref, safe = autocast_pair("cpu")
    compiled = torch.compile(safe, fullgraph=True)
    x = torch.randn(6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref, y = ref(x), compiled(x)
    assert y.dtype == torch.bfloat16
    assert_matches(y, y_ref, rel=PARITY[torch.bfloat16])


# ---------------------------------------------------------------------------
# The deprecated cast policy
# ---------------------------------------------------------------------------
def test_cast_policy_is_deprecated_but_still_works() -> None:
    with pytest.warns(FutureWarning, match="dtype_policy='cast' is deprecated"):
        layer = cg.SafeLinear(4, 2, dtype_policy="cast")
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = layer(x)
    assert out.dtype == torch.bfloat16
    assert_matches(out, F.linear(x.float(), layer.weight, layer.bias).bfloat16(), rel=PARITY[torch.bfloat16])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cg.SafeLinear(4, 2)  # the default warns about nothing
