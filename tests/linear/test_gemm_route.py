"""The GEMM path (CUBLAS_GUARD_GEMM_PATH=legacy|lt): which routine a call starts with,
when a cuBLASLt attempt falls back to cublasGemmEx, and the bias prefill's CPU twin, all on any
machine; then, on a GPU, both paths against F.linear and the fallback and the failure report."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers import assert_matches, requires_cuda

T = torch.ops.cublas_guard_testing
OK, NOT_SUPPORTED, EXECUTION_FAILED, INVALID_VALUE = 0, 15, 13, 7


def route(
    dtype: str,
    path: str,
    has_bias: bool = True,
    use_64bit: bool = False,
    lt_available: bool = True,
    steps: tuple[int, ...] = (),
) -> list[str]:
    return T.gemm_route(dtype, path, has_bias, use_64bit, lt_available, list(steps))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_lt_path_takes_half_precision_bias_gemms_to_cublaslt(dtype: str) -> None:
    assert route(dtype, "lt")[0] == "cublasLtMatmul"
    assert route(dtype, "legacy")[0] == "cublasGemmEx"  # the default path is unchanged
    assert route(dtype, "")[0] == "cublasGemmEx"  # unset = legacy
    assert route(dtype, "lt", has_bias=False)[0] == "cublasGemmEx"  # gradients, bias-less layers
    assert route(dtype, "lt", use_64bit=True)[0] == "cublasGemmEx"  # the _64 routine
    assert route(dtype, "lt", lt_available=False)[0] == "cublasGemmEx"  # torch < 2.7


@pytest.mark.parametrize("path", ["lt", "legacy"])
def test_float32_and_float64_keep_their_direct_routines(path: str) -> None:
    assert route("float32", path)[0] == "cublasSgemm"
    assert route("float64", path)[0] == "cublasDgemm"


def test_cublaslt_refusing_falls_back_and_other_failures_are_reported() -> None:
    verdicts = route(
        "bfloat16",
        "lt",
        steps=(
            OK,
            0,
            1,  # a descriptor step that worked
            OK,
            1,
            1,  # the heuristic found an algorithm
            OK,
            1,
            0,  # ... found none: cuBLASLt refuses the case
            NOT_SUPPORTED,
            0,
            1,  # any step answering NOT_SUPPORTED
            NOT_SUPPORTED,
            1,
            0,
            EXECUTION_FAILED,
            0,
            1,  # the matmul failed: reported, not hidden by a fallback
            INVALID_VALUE,
            1,
            0,  # the heuristic query answered INVALID_VALUE: a layout it does not take
            INVALID_VALUE,
            0,
            1,  # a descriptor refused its argument: reported
            EXECUTION_FAILED,
            1,
            0,  # the heuristic query failed otherwise: reported
        ),
    )
    assert verdicts[1:] == [
        "continue",
        "continue",
        "fall_back",
        "fall_back",
        "fall_back",
        "report",
        "fall_back",
        "report",
        "report",
    ]


def test_d_declares_the_smaller_of_c_and_the_bias_alignment() -> None:
    """A split piece's C starts m0 + n0 * ldc elements into the output; cuBLASLt must not pick a
    kernel for an alignment D (= C) does not have, whatever the bias's."""
    base = 1 << 20  # 256-byte aligned
    assert T.lt_alignments(base, base + 16, base + 256, base + 512) == [256, 16, 256, 256]
    assert T.lt_alignments(base, base, base + 2, base) == [256, 256, 2, 2]  # bf16 piece at m0 = 1
    assert T.lt_alignments(base, base, base, base + 6) == [256, 256, 256, 2]  # the bias offset by 3
    assert T.lt_alignments(base, base, base + 8, base + 4) == [256, 256, 8, 4]
    assert T.lt_alignments(base + 128, base + 64, base + 32, base + 32) == [128, 64, 32, 32]


KEY_FIELDS = T.lt_plan_key_fields()
BASE_KEY = dict(
    device=0,
    dtype=15,
    accumulate16=0,
    reduction=0,
    trans_a=1,
    trans_b=0,
    m=4096,
    n=8192,
    k=4096,
    lda=4096,
    ldb=4096,
    ldc=4096,
    align_a=256,
    align_b=256,
    align_c=256,
    align_d=256,
    workspace_size=32 << 20,
)


def keys(*dicts: dict) -> list[int]:
    return [d[name] for d in dicts for name in KEY_FIELDS]


def test_a_cached_lt_plan_is_found_only_for_the_same_key() -> None:
    """The cuBLASLt plan (descriptors and heuristic answer) is reused for a key with every
    field equal, and for no other: a plan for another shape, layout, alignment, dtype or torch
    flag would run the wrong kernel."""
    assert sorted(KEY_FIELDS) == sorted(BASE_KEY)
    assert T.lt_plan_cache_trace(8, keys(BASE_KEY, BASE_KEY, BASE_KEY)) == ["miss", "hit 0", "hit 0"]
    for name in KEY_FIELDS:
        if name in ("accumulate16", "trans_a", "trans_b"):
            other = {**BASE_KEY, name: 1 - BASE_KEY[name]}
        else:
            other = {
                **BASE_KEY,
                name: BASE_KEY[name] // 2 if name.startswith("align") else BASE_KEY[name] + 1,
            }
        trace = T.lt_plan_cache_trace(8, keys(BASE_KEY, other, other, BASE_KEY))
        assert trace == ["miss", "miss", "hit 1", "hit 0"], name


def test_the_plan_cache_evicts_the_least_recently_used() -> None:
    a, b, c = ({**BASE_KEY, "n": n} for n in (1, 2, 3))
    # capacity 2: a, b; a used again; c evicts b (least recently used), so b misses, a hits.
    trace = T.lt_plan_cache_trace(2, keys(a, b, a, c, b, c, a))
    assert trace == ["miss", "miss", "hit 0", "miss", "miss", "hit 3", "miss"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gemm_ex_refuses_split_k_off_as_torch_does(dtype: str) -> None:
    """torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction = (False, False)
    turns split-K off, which only cuBLASLt can do: cublasGemmEx refuses before the call with a
    CublasError (a RuntimeError, as torch's own refusal) instead of running with split-K."""
    for allowed in (0, 1):  # reduced precision allowed; or disallowed with split-K
        T.gemm_ex_reduction_check(dtype, allowed, "half")
    for other in ("float32", "float64"):  # no such setting: nothing to refuse
        T.gemm_ex_reduction_check(other, 2, "full")
    with pytest.raises(cg.CublasError) as info:
        T.gemm_ex_reduction_check(dtype, 2, "half")
    err = info.value
    assert isinstance(err, RuntimeError)
    setting = f"torch.backends.cuda.matmul.allow_{'bf16' if dtype == 'bfloat16' else 'fp16'}_reduced_precision_reduction"
    f = err.fields
    assert (f["status"], f["status_name"], f["precheck"], f["api"]) == (
        NOT_SUPPORTED,
        "CUBLAS_STATUS_NOT_SUPPORTED",
        True,
        "cublasGemmEx",
    )
    assert f["rule"].startswith(f"{setting} = (False, False) turns split-K off")
    assert f"{setting} = (False, True)" in f["rule"]
    assert "layer 'half'" in str(err) and "refused before the call" in str(err)


@pytest.mark.parametrize(
    ("args", "trans_a", "rule"),
    [
        ([-1, 16, 64, 64, 64, 48], False, "m, n and k must be >= 0"),
        ([48, 16, 64, 47, 64, 48], False, "lda >= max(1, rows of A as stored)"),  # A is m x k: lda >= m
        ([48, 16, 64, 63, 64, 48], True, "lda >= max(1, rows of A as stored)"),  # A^T stored k x m: lda >= k
        ([48, 16, 64, 48, 63, 48], False, "ldb >= max(1, rows of B as stored)"),
        ([48, 16, 64, 48, 64, 47], False, "ldc >= max(1, m)"),
    ],
)
def test_a_call_breaking_cublas_s_rules_is_refused_naming_the_rule(args, trans_a: bool, rule: str) -> None:
    """cuBLAS answers INVALID_VALUE without saying why; the plan checks its rules first and
    names the one broken, with the call's arguments, and never sends the call."""
    T.gemm_rules_check([48, 16, 64, 64 if trans_a else 48, 64, 48], trans_a, False, "ok")  # the rules hold
    with pytest.raises(cg.CublasError) as info:
        T.gemm_rules_check(args, trans_a, False, "rules")
    f = info.value.fields
    assert (f["status"], f["status_name"], f["precheck"], f["rule"]) == (
        INVALID_VALUE,
        "CUBLAS_STATUS_INVALID_VALUE",
        True,
        rule,
    )
    assert [f[k] for k in ("m", "n", "k", "lda", "ldb", "ldc")] == args
    assert (f["transa"], f["transb"], f["api"], f["data_type"]) == (
        "T" if trans_a else "N",
        "N",
        "cublasSgemm",
        "CUDA_R_32F",
    )
    assert str(info.value).startswith(
        f"layer 'rules': CUBLAS_STATUS_INVALID_VALUE (refused before the call): the arguments break the rule {rule}"
    )


@pytest.mark.locked
def test_torch_s_own_setting_is_what_the_cuda_path_reads() -> None:
    """-1: the option as gemm_cuda reads it from torch (torch_reduction_option)."""
    matmul = torch.backends.cuda.matmul
    old = matmul.allow_bf16_reduced_precision_reduction
    try:
        matmul.allow_bf16_reduced_precision_reduction = (False, True)
        T.gemm_ex_reduction_check("bfloat16", -1, "half")
        matmul.allow_bf16_reduced_precision_reduction = (False, False)
        T.gemm_ex_reduction_check("float16", -1, "half")  # fp16's own setting is still on
        with pytest.raises(cg.CublasError, match="allow_bf16_reduced_precision_reduction"):
            T.gemm_ex_reduction_check("bfloat16", -1, "half")
    finally:
        matmul.allow_bf16_reduced_precision_reduction = old


def test_torch_s_cublas_settings_have_their_hand_over_ops() -> None:
    """The stable core cannot read torch's cuBLAS settings: the package hands them over through
    these internal ops (no-ops in the version-locked library, which reads torch itself). Called
    here with torch's own values, so that neither library changes what it does."""
    internal = torch.ops.cublas_guard_internal
    assert str(internal.set_reduction_options.default._schema) == (
        "cublas_guard_internal::set_reduction_options(int fp16, int bf16) -> ()"
    )
    assert str(internal.set_fp16_accumulation.default._schema) == (
        "cublas_guard_internal::set_fp16_accumulation(bool allow) -> ()"
    )
    internal.set_fp16_accumulation(
        bool(getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", False))
    )


def test_a_bad_path_name_is_refused() -> None:
    with pytest.raises(ValueError, match="neither 'legacy' nor 'lt'"):
        route("float32", "cublaslt")
    with pytest.raises(ValueError, match="neither 'legacy' nor 'lt'"):
        T.set_gemm_path("fast")


@pytest.mark.slow
def test_the_environment_variable_chooses_the_path_once_per_process() -> None:
    code = "import torch, cublas_guard_ext; print(torch.ops.cublas_guard_testing.gemm_path())"
    env = {**os.environ, "CUBLAS_GUARD_EXT_TESTING": "1"}
    for value, expected in (("lt", "lt"), ("legacy", "legacy"), ("", "legacy")):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, "CUBLAS_GUARD_GEMM_PATH": value},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0 and out.stdout.split() == [expected], out.stdout + out.stderr
    env.pop("CUBLAS_GUARD_GEMM_PATH", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["legacy"], out.stdout + out.stderr  # the default
    bad = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "CUBLAS_GUARD_GEMM_PATH": "Lt"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode != 0
    assert "CUBLAS_GUARD_GEMM_PATH='Lt' is not a GEMM path" in bad.stderr
    assert "CUBLAS_GUARD_GEMM_PATH=lt" in bad.stderr


@pytest.mark.parametrize(
    "m,n,ldc", [(1, 1, 1), (7, 5, 7), (7, 5, 11), (300, 3, 300), (1, 9, 4), (33, 17, 40)]
)
@pytest.mark.parametrize("workers,lanes", [(1, 1), (3, 32), (8, 1024), (1000, 7)])
def test_the_prefill_twin_writes_the_bias_into_every_column_and_nothing_else(
    m: int, n: int, ldc: int, workers: int, lanes: int
) -> None:
    """The loop the prefill kernels run (one worker per block, one lane per thread), on the CPU:
    column-major C[m x n] with leading dimension ldc, padding rows untouched."""
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + ldc)
    bias = torch.randn(m, generator=gen)
    storage = torch.full(((n - 1) * ldc + m + 3,), 12345.0)
    T.prefill_bias_twin(storage, bias, m, n, ldc, workers, lanes)
    expected = torch.full_like(storage, 12345.0)
    for col in range(n):
        expected[col * ldc : col * ldc + m] = bias
    assert torch.equal(storage, expected)


def test_the_prefill_twin_refuses_a_block_that_does_not_fit() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        T.prefill_bias_twin(torch.zeros(10), torch.zeros(4), 4, 3, 4, 1, 1)  # needs 12 elements
    with pytest.raises(ValueError, match="does not fit"):
        T.prefill_bias_twin(torch.zeros(40), torch.zeros(4), 4, 3, 3, 1, 1)  # ldc < m


# ---------------------------------------------------------------------------------------------
# On a GPU: both paths, every dtype, every mode, against F.linear.
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def gemm_path():
    previous: list[str] = []

    def use(path: str) -> None:
        previous.append(T.set_gemm_path(path))

    yield use
    if previous:
        T.set_gemm_path(previous[0])


TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@requires_cuda
@pytest.mark.parametrize("path", ["legacy", "lt"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["off", "async", "sync"])
@pytest.mark.parametrize("shape", [(32, 1024, 1024), (257, 300, 77), (3, 40000, 8), (1, 8, 70000)])
def test_both_paths_match_f_linear_forward_and_backward(gemm_path, path, dtype, mode, shape) -> None:
    gemm_path(path)
    m, k, n = shape
    layer = cg.SafeLinear(k, n, device="cuda", dtype=dtype, mode=mode, name=f"{path}_{mode}")
    x = torch.randn(m, k, device="cuda", dtype=dtype, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    ref = F.linear(ref_x, layer.weight, layer.bias)
    assert_matches(y, ref, rel=TOL[dtype])
    grad = torch.randn_like(y)
    y.backward(grad)
    w_grad, b_grad = layer.weight.grad.clone(), layer.bias.grad.clone()
    layer.zero_grad()
    ref.backward(grad)
    assert_matches(x.grad, ref_x.grad, rel=TOL[dtype])
    assert_matches(w_grad, layer.weight.grad, rel=TOL[dtype])
    assert_matches(b_grad, layer.bias.grad, rel=TOL[dtype])
    cg.check()


# A GEMM split in m, n and k under a lowered 32-bit limit (no 64-bit API): the leading
# dimensions must fit the limit (they cannot be split), so the weight is contiguous (lda = K,
# m splits) and the input stored transposed (ldb = the batch, k splits). The planner
# (linear_common.cpp's gemm_steps) then takes m = 6, n = 9, k = 7 steps: 5 x 4 x 6 pieces with
# uneven last ones.
SPLIT_LIMIT = 256
SPLIT_BATCH, SPLIT_IN, SPLIT_OUT = 33, 37, 29
SPLIT_FIRST_PIECE = "m 0..6 of 29, n 0..9 of 33, k 0..7 of 37"
SPLIT_CASES = [
    ("cpu", "legacy", torch.float32),
    ("cpu", "legacy", torch.float64),
    ("cpu", "legacy", torch.bfloat16),
] + [
    pytest.param("cuda", path, dtype, marks=requires_cuda)
    for path in ("legacy", "lt")
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
]


def split_layer_and_input(device: str, dtype: torch.dtype) -> tuple[cg.SafeLinear, torch.Tensor]:
    layer = cg.SafeLinear(SPLIT_IN, SPLIT_OUT, device=device, dtype=dtype, mode="async", name="split")
    with torch.no_grad():  # a bias added to two k pieces would be off by about 10
        layer.bias.copy_(10.0 + torch.randn(SPLIT_OUT, device=device, dtype=dtype))
    x = torch.randn(SPLIT_IN, SPLIT_BATCH, device=device, dtype=dtype).t()  # ldb = 33
    return layer, x


@pytest.mark.parametrize("device,path,dtype", SPLIT_CASES)
def test_a_gemm_split_in_m_n_and_k_adds_the_bias_once_per_output(
    gemm_path, size_limit, inject_fault, device, path, dtype
) -> None:
    """Beyond the (lowered) 32-bit limit the forward GEMM is split in m, n and k: the bias enters
    the first k piece of every m range only (cuBLASLt's epilogue on the lt path), later k pieces
    accumulate. On the CPU the same planner splits the same call (torch's addmm runs each piece)."""
    gemm_path(path)
    size_limit(SPLIT_LIMIT, allow_64bit=False)
    layer, x = split_layer_and_input(device, dtype)
    inject_fault("gemm", EXECUTION_FAILED)  # the first piece fails: its report names it
    with pytest.raises(cg.CublasError) as info, torch.no_grad():
        layer(x)
    assert info.value.fields["chunk"] == SPLIT_FIRST_PIECE
    assert (info.value.fields["m"], info.value.fields["n"], info.value.fields["k"]) == (6, 9, 7)
    with torch.no_grad():
        got = layer(x)
        want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert_matches(got.double(), want, rel=TOL[dtype])
    cg.check()


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cublaslt_refusing_falls_back_to_gemmex_with_the_same_result(gemm_path, inject_fault, dtype) -> None:
    gemm_path("lt")
    layer = cg.SafeLinear(64, 48, device="cuda", dtype=dtype, mode="off", name="refused")
    x = torch.randn(16, 64, device="cuda", dtype=dtype)
    with torch.no_grad():
        inject_fault("gemm", NOT_SUPPORTED)  # cublasLtMatmul answers NOT_SUPPORTED
        y = layer(x)
    assert_matches(y, F.linear(x, layer.weight, layer.bias), rel=TOL[dtype])


@requires_cuda
def test_a_cublaslt_failure_names_the_call_and_its_descriptors(gemm_path, inject_fault) -> None:
    gemm_path("lt")
    layer = cg.SafeLinear(64, 48, device="cuda", dtype=torch.bfloat16, name="lt_fails")
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    inject_fault("gemm", EXECUTION_FAILED)
    with pytest.raises(cg.CublasError) as info:
        layer(x)
    f = info.value.fields
    assert f["api"] == "cublasLtMatmul" and f["status_name"] == "CUBLAS_STATUS_EXECUTION_FAILED"
    assert f["gemm_path"] == "lt"
    for needed in (
        "CUBLASLT_EPILOGUE_BIAS",
        "CUDA_R_16BF",
        "CUBLAS_COMPUTE_32F",
        "MAX_WORKSPACE_BYTES",
        "rows 48",
        "ld 64",
    ):
        assert needed in f["descriptors"], f["descriptors"]
    assert "cublasLtMatmul" in str(info.value)


@requires_cuda
def test_fp16_accumulation_is_honoured_and_reported(gemm_path, inject_fault) -> None:
    if not hasattr(torch.backends.cuda.matmul, "allow_fp16_accumulation"):
        pytest.skip("this torch has no allow_fp16_accumulation")
    layer = cg.SafeLinear(64, 48, device="cuda", dtype=torch.float16, bias=False, name="acc16")
    x = torch.randn(16, 64, device="cuda", dtype=torch.float16)
    old = torch.backends.cuda.matmul.allow_fp16_accumulation
    try:
        torch.backends.cuda.matmul.allow_fp16_accumulation = True
        with torch.no_grad():
            assert_matches(layer(x), F.linear(x, layer.weight), rel=2e-2)
        inject_fault("gemm", EXECUTION_FAILED)
        with pytest.raises(cg.CublasError) as info:
            layer(x)
        assert info.value.fields["compute_type"] == "CUBLAS_COMPUTE_16F"
    finally:
        torch.backends.cuda.matmul.allow_fp16_accumulation = old


@requires_cuda
@pytest.mark.parametrize("mode", ["off", "async", "sync"])
def test_a_strided_bias_is_prefilled_right_on_the_lt_path(gemm_path, mode) -> None:
    gemm_path("lt")
    for dtype in (torch.float32, torch.bfloat16):
        layer = cg.SafeLinear(32, 16, device="cuda", dtype=dtype, mode=mode, name="strided_bias")
        wide = torch.randn(32, device="cuda", dtype=dtype)
        with torch.no_grad():
            layer.bias = torch.nn.Parameter(wide[::2])  # stride 2: no epilogue, our prefill
            x = torch.randn(8, 32, device="cuda", dtype=dtype)
            assert_matches(layer(x), F.linear(x, layer.weight, layer.bias), rel=TOL[dtype])


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_cached_lt_plan_takes_each_call_s_own_bias(gemm_path, dtype) -> None:
    """Two layers of one shape share a cached cuBLASLt plan; each call must still add its own
    bias (the plan's BIAS_POINTER is set per call), alternating, and a third shape in between."""
    gemm_path("lt")
    a = cg.SafeLinear(64, 48, device="cuda", dtype=dtype, mode="off", name="plan_a")
    b = cg.SafeLinear(64, 48, device="cuda", dtype=dtype, mode="off", name="plan_b")
    c = cg.SafeLinear(64, 40, device="cuda", dtype=dtype, mode="off", name="plan_c")
    with torch.no_grad():
        b.bias.add_(5.0)
        x = torch.randn(16, 64, device="cuda", dtype=dtype)
        for layer in (a, b, c, a, b, a, c, b):
            assert_matches(layer(x), F.linear(x, layer.weight, layer.bias), rel=TOL[dtype])


@requires_cuda
@pytest.mark.parametrize("path", ["legacy", "lt"])
def test_split_k_off_is_refused_where_cublasgemmex_would_run(gemm_path, path) -> None:
    """allow_bf16_reduced_precision_reduction = (False, False): cuBLASLt's bias GEMM honours it
    (lt path, forward with a bias); every GEMM that goes to cublasGemmEx refuses it."""
    matmul = torch.backends.cuda.matmul
    try:
        old = matmul.allow_bf16_reduced_precision_reduction
        matmul.allow_bf16_reduced_precision_reduction = (False, False)
    except (TypeError, RuntimeError, AttributeError):
        pytest.skip("this torch has no allow_splitk setting")
    gemm_path(path)
    try:
        layer = cg.SafeLinear(64, 48, device="cuda", dtype=torch.bfloat16, mode="off", name="splitk")
        x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        if path == "lt":
            y = layer(x)  # cuBLASLt with REDUCTION_SCHEME_NONE
            assert_matches(y, F.linear(x, layer.weight, layer.bias), rel=TOL[torch.bfloat16])
            with pytest.raises(cg.CublasError, match="split-K off"):
                y.sum().backward()  # the gradients' GEMMs are cublasGemmEx
        else:
            with pytest.raises(cg.CublasError, match="split-K off") as info:
                layer(x)
            assert info.value.fields["precheck"] and info.value.fields["api"] == "cublasGemmEx"
    finally:
        matmul.allow_bf16_reduced_precision_reduction = old
