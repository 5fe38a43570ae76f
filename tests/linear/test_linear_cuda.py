"""CUDA-only tests: they skip without a GPU and run in benchmarks/gpu/gpu_check.sh.

(The device-parametrized tests in the other files also run on CUDA there.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import cublas_guard_ext as cg

from helpers import HAS_CUDA, assert_matches, gemm_spans

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and the CUDA build")

NAN, INF = float("nan"), float("inf")


def scan_tuple(x: torch.Tensor) -> tuple[int, int, int, int]:
    r = cg.scan(x)
    return (r.nan_count, r.posinf_count, r.neginf_count, r.first_bad_index)


@pytest.mark.parametrize("n", [1, 3, 4097, 32768, 32769, 1 << 22, (1 << 24) + 3])
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_scan_matches_cpu_across_grid_sizes_and_alignments(n: int, offset: int) -> None:
    """Single- and multi-block grids, and the scalar head before the 16-byte boundary."""
    base = torch.randn(n + offset)
    gen = torch.Generator().manual_seed(n + offset)
    positions = torch.randint(0, n + offset, (7,), generator=gen)
    base[positions] = torch.tensor([NAN, INF, -INF, NAN, INF, -INF, NAN])
    cpu_view = base[offset:]
    gpu_view = base.cuda()[offset:]
    assert scan_tuple(gpu_view) == scan_tuple(cpu_view)


def test_scan_strided_on_gpu_matches_cpu() -> None:
    base = torch.randn(300, 500)
    base[17, 400] = NAN
    base[250, 3] = -INF
    for view_fn in (lambda t: t.t(), lambda t: t[::3, 5:300], lambda t: t[:, 1::2].t()):
        assert scan_tuple(view_fn(base.cuda())) == scan_tuple(view_fn(base))


def test_scan_runs_on_the_current_stream() -> None:
    stream = torch.cuda.Stream()
    x = torch.randn(1 << 20, device="cuda")
    stream.wait_stream(torch.cuda.current_stream())  # randn ran on the default stream
    with torch.cuda.stream(stream):
        x.mul_(2.0)
        x[12345] = NAN  # enqueued on `stream`: the scan must see it
        result = cg.scan(x)
    stream.synchronize()
    assert result.first_bad_index == 12345


@pytest.mark.parametrize("m,k,n", [(1, 1024, 1024), (32, 1024, 1024), (512, 4096, 4096), (257, 300, 77)])
def test_linear_matches_f_linear_tf32_off(m: int, k: int, n: int) -> None:
    layer = cg.SafeLinear(k, n, device="cuda")
    x = torch.randn(m, k, device="cuda")
    assert_matches(layer(x), F.linear(x, layer.weight, layer.bias), rel=1e-5)


def test_math_mode_is_reported(inject_fault) -> None:
    layer = cg.SafeLinear(64, 32, device="cuda", name="tf32")
    x = torch.randn(8, 64, device="cuda")
    for allow, expected in ((False, "CUBLAS_DEFAULT_MATH"), (True, "CUBLAS_TF32_TENSOR_OP_MATH")):
        torch.backends.cuda.matmul.allow_tf32 = allow
        inject_fault("gemm", 13)
        with pytest.raises(cg.CublasError) as info:
            layer(x)
        assert expected in info.value.math_mode
        assert "sm_" in info.value.device
    torch.backends.cuda.matmul.allow_tf32 = False


def test_handle_failure_is_reported(inject_fault) -> None:
    inject_fault("handle", 1)
    with pytest.raises(cg.CublasError) as info:
        cg.SafeLinear(16, 8, device="cuda", name="h")(torch.randn(2, 16, device="cuda"))
    assert info.value.status_name == "CUBLAS_STATUS_NOT_INITIALIZED"
    assert "creating the cuBLAS handle" in str(info.value)


def test_launch_failure_is_reported(inject_fault) -> None:
    inject_fault("launch", 209)  # cudaErrorNoKernelImageForDevice
    with pytest.raises(cg.CudaLaunchError) as info:
        cg.SafeLinear(16, 8, device="cuda", name="k")(torch.randn(2, 16, device="cuda"))
    assert info.value.cuda_error == "cudaErrorNoKernelImageForDevice"
    assert "TORCH_CUDA_ARCH_LIST=" in str(info.value)
    cg.SafeLinear(16, 8, device="cuda")(torch.randn(2, 16, device="cuda"))  # next call works


def test_async_forward_backward_never_syncs() -> None:
    model = cg.replace_linear(
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)),
        mode="async",
    ).cuda()
    x = torch.randn(64, 256, device="cuda")
    model(x).sum().backward()  # warm-up: the record's one-time allocation syncs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            model(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cg.check()


def test_async_mode_in_a_cuda_graph_reports_bad_replays() -> None:
    layer = cg.SafeLinear(128, 64, device="cuda", mode="async", name="graphed")
    static_x = torch.randn(32, 128, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graph wants
        for _ in range(3):
            layer(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = layer(static_x)
    static_x.copy_(torch.randn(32, 128, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(static_y, F.linear(static_x, layer.weight, layer.bias))
    cg.check()  # clean replays: nothing recorded
    static_x[4, 9] = NAN
    graph.replay()
    with pytest.raises(cg.NonFiniteInputError) as info:
        cg.check()
    assert info.value.layer == "graphed" and info.value.first_bad_coords == [4, 9]


def test_sync_mode_refuses_graph_capture() -> None:
    layer = cg.SafeLinear(32, 16, device="cuda", mode="sync", name="s")
    x = torch.randn(4, 32, device="cuda")
    layer(x)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(cg.GraphCaptureError, match="mode='async'"):
        with torch.cuda.graph(graph):
            layer(x)
    assert_matches(layer(x), F.linear(x, layer.weight, layer.bias))  # eager still fine


PENDING = textwrap.dedent(
    """
    import torch, cublas_guard_ext as cg
    emb = torch.nn.Embedding(10, 32).cuda()
    layer = cg.SafeLinear(32, 8, device="cuda", name="after_embedding")
    idx = torch.tensor([1, 2, 99], device="cuda")  # 99 >= 10: a device-side assert
    h = emb(idx)
    try:
        layer(h)
    except cg.PendingCudaError as err:
        print("PENDING", err.cuda_error, err.layer)
        print(err)
    """
)


def test_earlier_async_error_is_attributed_to_the_earlier_kernel() -> None:
    """In a subprocess: a device-side assert leaves the CUDA context unusable."""
    env = dict(os.environ)
    env.pop("CUDA_LAUNCH_BLOCKING", None)
    result = subprocess.run(
        [sys.executable, "-c", PENDING], capture_output=True, text=True, timeout=300, env=env
    )
    assert "PENDING cudaErrorAssert after_embedding" in result.stdout, result.stdout + result.stderr
    assert "EARLIER CUDA kernel failed" in result.stdout
    assert "CUDA_LAUNCH_BLOCKING=1" in result.stdout and "nn.Embedding" in result.stdout


@pytest.mark.parametrize("mode", ["async", "off"])
def test_torch_compile_fullgraph_on_cuda_matches_eager(mode: str) -> None:
    model = cg.replace_linear(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)),
        mode=mode,
    ).cuda()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(16, 64, device="cuda", requires_grad=True)
    eager = model(x)
    eager.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    out = compiled(x)
    out.square().sum().backward()
    assert_matches(out, eager)
    for got, want in zip([x.grad] + [p.grad for p in model.parameters()], grads):
        assert_matches(got, want)


def test_a_batch_beyond_int32_on_the_gpu(inject_fault) -> None:
    """A real batch of 2^31 + 7 rows: split into pieces the 32-bit API takes, none of whose
    operands spans 2^31 elements or more (x's rows are 2 apart, y's 3: about 715M rows a piece)."""
    rows = 2**31 + 7
    need = rows * (2 + 3) * 4 + (2 << 30)
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} free")
    layer = cg.SafeLinear(2, 3, device="cuda", mode="off")
    x = torch.randn(rows, 2, device="cuda")
    with torch.no_grad():
        y = layer(x)
        step = 1 << 27
        for start in range(0, rows, step):  # every row, against torch's own GEMM
            sl = slice(start, min(start + step, rows))
            assert_matches(y[sl], F.linear(x[sl], layer.weight, layer.bias))
        del y
        inject_fault("gemm", 13)  # the first (largest) piece's arguments, as cuBLAS would get them
        with pytest.raises(cg.CublasError) as info:
            layer(x)
    assert info.value.api == "cublasSgemm", info.value.chunk
    assert max(gemm_spans(info.value.fields).values()) < 2**31, info.value.fields
    del x
    torch.cuda.empty_cache()


def _cudart():
    """The CUDA runtime torch loaded (the same per-thread last-error state), through ctypes."""
    import ctypes
    from pathlib import Path

    torch.cuda.init()
    paths = sorted(
        {
            line.split()[-1]
            for line in Path("/proc/self/maps").read_text().splitlines()
            if "libcudart.so" in line
        }
    )
    if not paths:
        pytest.skip("torch's CUDA runtime is linked statically: no libcudart to call")
    return ctypes.CDLL(paths[0])


@pytest.mark.parametrize("mode,path", [("async", "legacy"), ("async", "lt"), ("off", "lt")])
def test_a_stale_non_sticky_error_is_not_blamed_on_the_scan(mode: str, path: str) -> None:
    """cudaStreamQuery on a busy stream leaves cudaErrorNotReady as the thread's last error;
    the next guarded call's launch check (the scan's; in off mode on the lt path the bias
    prefill's) must not report it as its own."""
    import ctypes

    cudart = _cudart()
    previous = torch.ops.cublas_guard_testing.set_gemm_path(path)
    try:
        _stale_error_round(cudart, ctypes, mode)
    finally:
        torch.ops.cublas_guard_testing.set_gemm_path(previous)


def _stale_error_round(cudart, ctypes, mode: str) -> None:
    layer = cg.SafeLinear(64, 32, device="cuda", mode=mode, name="stale")
    x = torch.randn(16, 64, device="cuda")
    layer(x)
    torch.cuda._sleep(200_000_000)  # keep the stream busy
    rc = cudart.cudaStreamQuery(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert rc == 600  # cudaErrorNotReady, left behind
    y = layer(x)
    torch.cuda.synchronize()
    assert_matches(y, F.linear(x, layer.weight, layer.bias))
    cg.check()
